"""Streams against a long prompt: the longest gap between two tokens of running streams while a long
prompt is prefilled, and that prompt's time to first token, with mixed steps and with steps that are
all prefill or all decode, for several step budgets (max_num_batched_tokens).

Through EngineThread, as the console uses it: `--streams` requests decode (EOS ignored) until each has
`--warm` tokens, then one `--prompt-len` prompt arrives. Each stream's token times are taken on the
engine thread (the on_output hook). Reported per configuration: the streams' inter-token latency p50
before the prompt, the longest gap of any stream from the prompt's arrival to its first token, and the
prompt's time to first token; plus the prompt's time to first token alone (no streams). The first
trial ("cold") runs right after the engine starts: its streams' longest gap before the prompt shows
any first-time pause, and it lists the Triton kernels first specialised after start.

    python benchmarks/stream_gaps.py --model random:qwen3-8b --device cuda --prompt-len 32768 --streams 32
    python benchmarks/stream_gaps.py --model random:llama-tiny --device cpu --prompt-len 2048 --streams 2 \\
        --budgets 256,512
"""

from __future__ import annotations

import ast
import statistics
import threading
import time

import torch

from bench_common import cpu_description, device_description, parse_args, parser, write_json
from zipage.engine import EngineThread, SamplingParams


def token_clock(times: dict[int, list[float]], lock: threading.Lock):
    """An on_output hook that records when each request's tokens arrive (on the engine thread)."""
    def hook(out):
        if out.new_token_ids or out.delta or out.finished:
            with lock:
                times.setdefault(out.id, []).append(time.perf_counter())
    return hook


def wait_for(condition, what: str, timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


def trial(engine: EngineThread, args, long_prompt: list[int], streams: int) -> dict:
    """One long prompt against `streams` decoding requests; times in milliseconds."""
    times, lock = {}, threading.Lock()
    hook = token_clock(times, lock)
    gen = torch.Generator().manual_seed(args.seed)
    endless = SamplingParams(temperature=0.0, max_tokens=1_000_000, ignore_eos=True)
    vocab = engine.engine.prompts.vocab_size
    handles = [engine.submit(torch.randint(1, vocab, (args.stream_prompt_len,), generator=gen).tolist(), endless,
                             on_output=hook) for _ in range(streams)]
    count = lambda h: len(times.get(h.id, ()))  # noqa: E731
    wait_for(lambda: all(count(h) >= args.warm for h in handles), "the streams to warm up")
    arrived = time.perf_counter()
    long = engine.submit(long_prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), on_output=hook)
    long.result(timeout=600)
    first = times[long.id][0]
    after = {h.id: count(h) for h in handles}
    wait_for(lambda: all(count(h) >= after[h.id] + 4 for h in handles), "the streams to go on")
    for h in handles:
        engine.abort(h)
    for h in handles:
        h.result(timeout=600)
    result = dict(ttft_ms=round((first - arrived) * 1e3, 1))
    if streams:
        with lock:
            series = [list(times[h.id]) for h in handles]
        before = [b - a for s in series for a, b in zip(s, s[1:]) if b < arrived]
        # The gap each stream saw across the prompt's prefill: from its last token before the prompt
        # arrived to its first token after the prompt's first token.
        during = []
        for s in series:
            inside = [t for t in s if t >= arrived]
            last_before = max((t for t in s if t < arrived), default=arrived)
            span = [last_before] + [t for t in inside if t <= first] + [next(t for t in inside if t > first)]
            during.append(max(b - a for a, b in zip(span, span[1:])))
        result.update(itl_p50_before_ms=round(statistics.median(before) * 1e3, 2),
                      longest_gap_before_ms=round(max(before) * 1e3, 1),
                      longest_gap_ms=round(max(during) * 1e3, 1))
    return result


class CompileLog:
    """Triton kernels specialised for the first time in this process (compiled, or loaded from the
    disk cache), with when: a kernel that first runs while requests are streaming pauses them."""

    def __init__(self):
        self.events: list[tuple[float, str]] = []
        self.hooked = False
        try:
            import triton

            triton.knobs.runtime.jit_cache_hook = self._hook
            self.hooked = True
        except (ImportError, AttributeError):
            pass

    def _hook(self, *args, **kwargs):
        self.events.append((time.perf_counter(), str(kwargs.get("repr", ""))[:160]))
        return False  # compile as usual

    def since(self, start: float) -> list[str]:
        return [f"{t - start:+.2f}s {name}" for t, name in self.events if t >= start]


def main(argv=None) -> int:
    p = parser(__doc__, "random:qwen3-8b")
    p.add_argument("--device", default=None)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-prompt-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--warm", type=int, default=32, help="tokens every stream has before the long prompt comes")
    p.add_argument("--budgets", default="2048,4096,8192", help="max_num_batched_tokens values to try")
    p.add_argument("--modes", default="mixed,split", help="mixed: decode and prefill share steps; split: never")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--knob", action="append", default=[], help="extra engine knob NAME=VALUE (Python literal)")
    args = parse_args(p, argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    knobs = {}
    for item in args.knob:
        name, value = item.split("=", 1)
        knobs[name] = ast.literal_eval(value)
    # Built once with the largest budget (the activation peak is profiled for it), then lowered per trial.
    compiles = CompileLog()
    engine = EngineThread(args.model, device=args.device, max_num_batched_tokens=max(budgets), **knobs)
    ready = time.perf_counter()
    device = str(engine.engine.runner.device)
    results = dict(args=vars(args), hardware=device_description(device) if device.startswith("cuda") else cpu_description(),
                   trials=[])
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = engine.engine.prompts.vocab_size
    try:
        config = engine.engine.config
        warmup = torch.randint(1, vocab, (min(args.prompt_len, 4096),), generator=gen).tolist()
        # The first trial meets every kernel first: what it shows is what a freshly started engine shows.
        row = dict(budget=config.max_num_batched_tokens, mode="cold", **trial(engine, args, warmup, args.streams))
        row["kernels_first_used_after_start"] = compiles.since(ready)
        print(row, flush=True)
        results["trials"].append(row)
        warm = time.perf_counter()
        for budget in budgets:
            config.max_num_batched_tokens = budget
            for mode in args.modes.split(","):
                config.mixed_steps = mode == "mixed"
                for repeat in range(args.repeats):
                    long_prompt = torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()
                    row = dict(budget=budget, mode=mode, repeat=repeat, **trial(engine, args, long_prompt, args.streams))
                    print(row, flush=True)
                    results["trials"].append(row)
                    write_json(args.json, results)
            fresh = torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()  # nothing of it cached
            row = dict(budget=budget, mode="alone", **trial(engine, args, fresh, 0))
            print(row, flush=True)
            results["trials"].append(row)
            write_json(args.json, results)
        results["kernels_first_used_when_warm"] = compiles.since(warm)
        write_json(args.json, results)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
