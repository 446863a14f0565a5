"""GPU throughput under memory pressure: Zipage, the same engine with full KV, and transformers'
continuous batching (`generate_batch`), in one process.

    python3 benchmarks/gpu_throughput.py --model random:qwen3-0.6b --num-requests 256 \\
        --kv-cache-gb 16 --json out.json
    python3 benchmarks/gpu_throughput.py --model random:qwen3-0.6b --modes zipage,elastic,fullkv \\
        --num-requests 96 --kv-cache-gb 12 --json out.json

Modes: zipage (compression on, budgets as --budget-policy says, fixed by default), elastic (zipage
with elastic budgets: full KV while the pool has room, compressed to the budget when it is short),
zipage-fp8 and zipage-int8 (zipage with an 8-bit KV cache: about twice the blocks in the same
bytes), fullkv (compression off) and hf.

Workload: prompts of --min-input..--max-input random tokens, outputs of --min-output..--max-output
tokens (EOS ignored), drawn once from a fixed seed so every mode serves the same requests. The KV
pool is fixed with --kv-cache-gb (the same bytes for Zipage and full KV) to emulate a card whose
memory, not compute, caps concurrency. transformers' generate_batch takes one output length for a
whole batch, so it serves the same prompts with every output set to the workload's mean length
(the same total tokens).

Each engine mode reports the whole run and its saturated phase (see run_engine), its budget
policy and its compressions (pool_compressions: those run because the pool was short); the results
also hold the workload's KV footprint ceiling (zipage.cli.bench.kv_footprint) and the Zipage /
full-KV ratios (`ratios`, and `elastic_ratios` for the elastic mode; `fp8_ratios` and `int8_ratios`:
the 8-bit modes over zipage). --max-seconds bounds each
mode; --device cpu with --num-kv-blocks checks the script on a CPU with a tiny model.
--kernel-table-steps N records, 200 steps into each mode's saturated phase, the GPU time per kernel
and step over N steps (every stream; the steps it profiles are left out of the saturated rate).
"""

from __future__ import annotations

import gc
import json
import time

import torch

import bench_common


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(model: str, prompts, outputs, mode: str, engine_kwargs: dict, log,
               profile_path: str | None = None, max_seconds: float | None = None,
               kernel_table_steps: int = 0) -> dict:
    """Serve the workload to the end (or for max_seconds). Besides the whole run, it reports the
    saturated phase: from the first finished request until the waiting queue empties for the last
    time. There finished requests are replaced at once, so the pool, not the drain of the last
    requests, sets concurrency: the steady state of a server under load. With kernel_table_steps,
    the GPU time per kernel and step over that many steps, 200 steps into the saturated phase."""
    from zipage.engine.config import EngineConfig, SamplingParams
    from zipage.engine.core.engine_core import EngineCore
    from zipage.engine.events import Compressed

    engine_kwargs = dict(engine_kwargs, compression=mode != "fullkv")
    if mode == "elastic":
        engine_kwargs["budget_policy"] = "elastic"
    if mode in ("zipage-fp8", "zipage-int8"):
        engine_kwargs["kv_cache_dtype"] = mode.removeprefix("zipage-")
    engine = EngineCore(EngineConfig(model=model, **engine_kwargs))
    for p, n in zip(prompts, outputs):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    peak_running, peak_blocks_per_req, steps = 0, 0, 0
    saturated_from = saturated_to = None  # (seconds, tokens, steps) at the phase's ends
    cut_off = False
    synchronize()
    start = time.perf_counter()
    last_log = start
    profiler = None
    kernel_table = None
    profiled = None  # (seconds, tokens, steps) of the profiled steps, left out of the saturated phase
    profiled_until = 0  # the step count once they were done
    while engine.has_work():
        if profile_path and steps == 1000:  # host-side cost of 200 steady-state steps
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        finished = any(out.finished for out in engine.step())
        steps += 1
        now = time.perf_counter()
        mark = (now - start, engine.totals["generated_tokens"], steps)
        if finished and saturated_from is None:
            saturated_from = mark
        if saturated_from is not None and engine.scheduler.waiting:
            saturated_to = mark
            if kernel_table_steps and kernel_table is None and steps >= saturated_from[2] + 200:
                tokens = engine.totals["generated_tokens"]
                kernel_table = saturated_kernel_table(engine, kernel_table_steps)
                steps += kernel_table_steps
                profiled = (time.perf_counter() - start - mark[0], engine.totals["generated_tokens"] - tokens,
                            kernel_table_steps)
                profiled_until = steps
        if profiler is not None and steps == 1200:
            profiler.disable()
            import pstats
            with open(profile_path, "w") as f:
                pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)
            profiler = None
        running = engine.scheduler.running
        peak_running = max(peak_running, len(running))
        if steps % 64 == 0:
            peak_blocks_per_req = max([peak_blocks_per_req] + [len(s.block_table) for s in running])
        if max_seconds is not None and now - start > max_seconds:
            cut_off = True
            break
        if now - last_log > 15:
            log(f"  {mode}: {engine.totals['generated_tokens']} tokens, "
                f"{len(running)} running, {len(engine.scheduler.waiting)} waiting, {now - start:.0f} s")
            last_log = now
    synchronize()
    seconds = time.perf_counter() - start
    generated = engine.totals["generated_tokens"]
    durations = [e.seconds for e in engine.events if isinstance(e, Compressed)]
    saturated = None
    if saturated_from and saturated_to and saturated_to[0] > saturated_from[0]:
        span = [b - a for a, b in zip(saturated_from, saturated_to)]
        if profiled is not None and saturated_to[2] >= profiled_until:
            # the profiler slows the host several times over: its steps are not the engine's pace
            span = [a - b for a, b in zip(span, profiled)]
        saturated = {"tok_per_s": span[1] / span[0], "seconds": span[0], "tokens": span[1],
                     "mean_tokens_per_step": span[1] / max(span[2], 1)}
    result = {"cut_off": cut_off, "saturated": saturated, "mean_step_ms": 1000 * seconds / max(steps, 1),
              "mean_compression_ms": 1000 * sum(durations) / len(durations) if durations else None,
              "tok_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
              "peak_concurrency": peak_running, "steps": steps, "overlapped_steps": engine.overlapped_steps,
              "budget_policy": engine.config.budget_policy if engine.config.compression else None,
              "preemptions": engine.totals["preemptions"], "compressions": engine.totals["compressions"],
              "pool_compressions": engine.totals["pool_compressions"], "kv_blocks": engine.blocks.num_blocks,
              "block_size": engine.block_size, "query_slots": engine.runner.num_query_slots,
              "peak_blocks_per_request_sampled": peak_blocks_per_req,
              "kv_pool_gb": engine.runner.kv_bytes / (1 << 30)}
    if kernel_table is not None:
        result["saturated_kernel_table"] = kernel_table
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def saturated_kernel_table(engine, steps: int) -> dict:
    """Where a saturated step's GPU time goes: kernels per step over `steps` steps, and the wall time
    and requests decoded per step meanwhile. The profiler slows the host several times over, so
    these steps are left out of the saturated phase's rate."""
    running = []
    start = time.perf_counter()

    def step():
        running.append(len(engine.scheduler.running))
        engine.step()

    table = bench_common.kernel_breakdown(step, top=25, calls=steps)
    return {"steps": steps, "wall_ms_per_step": 1e3 * (time.perf_counter() - start) / steps,
            "mean_running": sum(running) / steps, "gpu_us_per_step_top25": round(sum(r["us"] for r in table), 1),
            "kernels": table}


def run_hf(model: str, prompts, outputs, log) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from zipage.engine.loading.loader import resolve_model

    source = resolve_model(model)
    if source.is_random:
        hf = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.bfloat16).cuda().eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.bfloat16).cuda().eval()
    mean_out = round(sum(outputs) / len(outputs))
    config = GenerationConfig(max_new_tokens=mean_out, min_new_tokens=mean_out, do_sample=False,
                              eos_token_id=source.tokenizer.eos_token_id, pad_token_id=0)
    synchronize()
    start = time.perf_counter()
    results = hf.generate_batch(inputs=prompts, generation_config=config)
    synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return {"tok_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
            "output_len_each": mean_out}


def ratios(mode: dict, base: dict) -> dict:
    """A mode over its base (a Zipage mode over full KV, 8-bit KV over bf16), for the whole run (only when
    neither was cut off) and the saturated phase."""
    out = {}
    if not mode.get("cut_off") and not base.get("cut_off") and "tok_per_s" in mode and "tok_per_s" in base:
        out["whole_run"] = mode["tok_per_s"] / base["tok_per_s"]
    if mode.get("saturated") and base.get("saturated"):
        out["saturated"] = mode["saturated"]["tok_per_s"] / base["saturated"]["tok_per_s"]
    return out


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-0.6b")
    parser.add_argument("--modes", default="zipage,fullkv,hf",
                        help="comma-separated: zipage, elastic (zipage with elastic budgets), zipage-fp8, zipage-int8, "
                             "fullkv, hf")
    bench_common.add_workload_flags(parser, num_requests=256, min_output=2048, max_output=8192, seed=0)
    parser.add_argument("--hf-num-requests", type=int, default=None, help="fewer requests for hf (default: all)")
    parser.add_argument("--kv-cache-gb", type=float, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="fix the pool in blocks instead")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--budget", type=int, default=8, help="max_cache_blocks_per_seq")
    parser.add_argument("--budget-policy", choices=("fixed", "elastic"), default="fixed",
                        help="budget policy of the zipage mode (the elastic mode is always elastic)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    parser.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                        help="overlapped decode steps (auto: on for CUDA)")
    parser.add_argument("--mixed-steps", choices=("on", "off"), default="on",
                        help="decode tokens and prefill chunks in the same steps (the engine's default: on)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (engine default)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the script")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop each engine mode after this long (its saturated phase still counts)")
    parser.add_argument("--profile-dir", default=None, help="write a host-side profile of each engine mode here")
    parser.add_argument("--kernel-table-steps", type=int, default=0,
                        help="record GPU time per kernel over this many saturated steps of each engine mode")
    bench_common.add_decode_launch_flag(parser)
    args = bench_common.parse_args(parser, argv)
    launches = bench_common.set_decode_launches(args.decode_launch) if args.decode_launch else None

    from zipage.cli.bench import kv_footprint

    prompts, outputs = bench_common.workload(args)
    engine_kwargs = dict(device=args.device, block_size=args.block_size, max_cache_blocks_per_seq=args.budget,
                         budget_policy=args.budget_policy,
                         max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb,
                         num_kv_blocks=args.num_kv_blocks,
                         enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
                         overlap_steps={"auto": None, "on": True, "off": False}[args.overlap],
                         mixed_steps=args.mixed_steps == "on")
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = {"model": args.model, **bench_common.device_description(args.device), "args": vars(args),
               "decode_launches": launches, "total_output_tokens": sum(outputs),
               # the concurrency compression can buy when the pool is the limit (see kv_footprint)
               "kv_footprint": kv_footprint([len(p) for p in prompts], outputs, args.block_size, args.budget),
               "modes": {}}
    log = lambda line: print(line, flush=True)  # noqa: E731
    log(f"workload KV footprint: {json.dumps(results['kv_footprint'])}")
    for mode in args.modes.split(","):
        log(f"{args.model} {mode} ...")
        try:
            if mode in ("zipage", "elastic", "zipage-fp8", "zipage-int8", "fullkv"):
                profile = f"{args.profile_dir}/profile_{mode}.txt" if args.profile_dir else None
                r = run_engine(args.model, prompts, outputs, mode, engine_kwargs, log, profile, args.max_seconds,
                               args.kernel_table_steps)
            elif mode == "hf":
                n = args.hf_num_requests or len(prompts)
                r = run_hf(args.model, prompts[:n], outputs[:n], log)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
        except Exception as e:  # record and go on: one failed mode must not lose the others
            r = {"error": f"{type(e).__name__}: {e}"}
        results["modes"][mode] = r
        done = results["modes"]
        for zipage_mode, base, key in (("zipage", "fullkv", "ratios"), ("elastic", "fullkv", "elastic_ratios"),
                                       ("zipage-fp8", "zipage", "fp8_ratios"), ("zipage-int8", "zipage", "int8_ratios")):
            # once both sides have run, in whichever order --modes gives them
            if mode in (zipage_mode, base) and zipage_mode in done and base in done:
                results[key] = ratios(done[zipage_mode], done[base])
                log(f"{zipage_mode} / {base}: {json.dumps(results[key])}")
        log(f"{args.model} {mode}: " + json.dumps(r))
        bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
