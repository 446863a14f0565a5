"""`zipage bench`: throughput of Zipage, the same engine with full KV, and transformers' continuous
batching, on the same weights and the same random-token prompts (greedy, fixed output length).
Mode "zipage" runs the engine's budget policy; mode "elastic" is Zipage with elastic budgets whatever
that policy, so one run can set fixed and elastic budgets side by side.

`run_bench` is the reusable entry point; `kv_footprint` gives the concurrency gain a workload allows.
torch and the engine are imported where they are used, so the command refuses bad arguments at once.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.loading.loader import resolve_model

MODES = ("zipage", "elastic", "fullkv", "hf")
SNAPSHOT_EVERY_S = 0.1  # how often a run samples the running-request count
WARMUP_OUTPUT_TOKENS = 8  # the warm-up run: every request of the workload, this many tokens each
COUNTS = ("compressions", "pool_compressions", "preemptions")  # engine totals each engine run reports

# progress(mode, tokens generated so far, tokens the mode generates in all its timed runs)
Progress = Callable[[str, int, int], None]


def random_prompts(vocab_size: int, num_requests: int, input_len: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_requests, input_len), generator=gen).tolist()


def run_bench(model: str, modes: list[str], num_requests: int, input_len: int, output_len: int,
              engine_kwargs: dict | None = None, progress: Progress | None = None, repeats: int = 3,
              note: Callable[[str], None] | None = None) -> dict:
    """Load every mode once, warm each up, then time `repeats` rounds; each round gives every mode the
    same fresh prompts, in an order that rotates from round to round (so drift in the machine's speed
    falls on every mode alike). Returns the settings and one result per mode: the median
    `tokens_per_s` and `seconds`, every run's figure, `output_tokens` per run, `peak_concurrency`,
    `ratio` of medians to the first mode, `within_noise` (the runs of the two modes overlap) and, for
    the engine modes, `budget_policy` and the last run's `compressions`, `pool_compressions` (run
    because the pool was short) and `preemptions`. `note` hears, before the timed runs, when
    compression cannot trigger on this workload."""
    engine_kwargs = dict(engine_kwargs or {})
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if not modes:
        raise ValueError("give at least one mode")
    for name, value in (("num_requests", num_requests), ("input_len", input_len), ("output_len", output_len),
                        ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    engine_kwargs.pop("model", None)
    engine_kwargs.pop("compression", None)  # the mode decides
    config = EngineConfig.from_kwargs(model, **engine_kwargs)  # validates the knobs before any load
    block_size = _block_size(config)
    footprint = kv_footprint([input_len] * num_requests, [output_len] * num_requests, block_size,
                             config.max_cache_blocks_per_seq)
    policies = {mode: _policy(mode, config) for mode in modes}
    elastic = [mode for mode in modes if policies[mode] == "elastic"]
    # Elastic budgets are checked once the pool is sized (below): they compress only when it is short.
    if note is not None and policies.get("zipage") == "fixed" and footprint["ratio"] == 1.0:
        note(f"compression cannot trigger: {input_len} + {output_len} tokens fit in the "
             f"{config.max_cache_blocks_per_seq + 1} blocks of {block_size} a request may hold, so zipage "
             "and fullkv do identical work here; raise --output-len or lower --max-cache-blocks-per-seq "
             "to see compression")
    vocab = resolve_model(model).hf_config.vocab_size
    runners = _load(model, modes, config, engine_kwargs)
    elastic_idle = None
    try:
        if elastic:  # the pool's size is known now
            elastic_idle = _elastic_idle(runners[elastic[0]].llm.engine, num_requests, input_len, output_len)
            if note is not None and elastic_idle:
                why, remedy = elastic_idle
                note(f"elastic compression cannot trigger: {why}, so {', '.join(elastic)} and fullkv do "
                     f"identical work here; {remedy} to see compression")
        warmup = random_prompts(vocab, num_requests, input_len, config.seed + repeats + 1)
        for mode in modes:  # first-call costs (allocation, lazy init, graph capture) stay out of the timing
            runners[mode](warmup, min(output_len, WARMUP_OUTPUT_TOKENS), lambda tokens: None)
        runs = {mode: [] for mode in modes}
        total = num_requests * output_len * repeats
        for round_ in range(repeats):
            # Fresh prompts each round: a repeat must not find the last round's prompts in the prefix cache.
            prompts = random_prompts(vocab, num_requests, input_len, config.seed + round_)
            for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
                before = sum(r["output_tokens"] for r in runs[mode])
                report = ((lambda tokens, m=mode, b=before: progress(m, b + tokens, total))
                          if progress else (lambda tokens: None))
                runs[mode].append(runners[mode](prompts, output_len, report))
    finally:
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
        _release_memory()
    results = [_summary(mode, runs[mode], policies[mode]) for mode in modes]
    base = results[0]
    for r in results:
        r["ratio"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
        r["within_noise"] = (r is not base and r["spread"][0] <= base["spread"][1]
                             and base["spread"][0] <= r["spread"][1])
    out = {"model": model, "num_requests": num_requests, "input_len": input_len, "output_len": output_len,
           "repeats": repeats, "device": results[0].get("device"), "results": results,
           # under fixed budgets: whether a request outgrows its budget
           "kv_footprint": footprint, "compression_can_trigger": footprint["ratio"] != 1.0}
    if elastic:
        out["elastic_can_trigger"] = elastic_idle is None
    return out


def _policy(mode: str, config: EngineConfig) -> str | None:
    """The budget policy a mode runs under; None for the modes without compression."""
    return {"zipage": config.budget_policy, "elastic": "elastic"}.get(mode)


def _elastic_idle(engine, num_requests: int, input_len: int, output_len: int) -> tuple[str, str] | None:
    """Why an elastic engine never compresses on this workload and what would change that, or None when
    it may. It compresses only a request above its floor, and only when the pool is short: when the
    pool holds the full KV of every request that can run at once, it keeps full KV throughout."""
    budget, block_size, pool = engine.config.max_cache_blocks_per_seq, engine.block_size, engine.blocks.num_blocks
    kv_len = input_len + output_len - 1  # the last token is sampled, never written to the cache
    if kv_len <= budget * block_size:
        return (f"{input_len} + {output_len} tokens never exceed the floor of {budget} "
                f"block{'s' if budget != 1 else ''} of {block_size}",
                "raise --output-len or lower --max-cache-blocks-per-seq")
    running = min(num_requests, engine.config.max_num_seqs, engine.runner.num_query_slots)  # each holds a slot
    full = running * -(-kv_len // block_size)
    if full <= pool:
        return (f"it compresses only when the pool is short, and the full KV of {running} requests at once "
                f"({full} blocks) fits in the pool of {pool}",
                "raise --num-requests or --output-len, or lower --num-kv-blocks or --kv-cache-gb")
    return None


def _summary(mode: str, runs: list[dict], policy: str | None) -> dict:
    rates = [r["tokens_per_s"] for r in runs]
    peaks = [r["peak_concurrency"] for r in runs if r["peak_concurrency"] is not None]
    out = {"mode": mode, "tokens_per_s": statistics.median(rates), "spread": (min(rates), max(rates)),
           "runs_tokens_per_s": rates, "seconds": statistics.median(r["seconds"] for r in runs),
           "output_tokens": runs[-1]["output_tokens"],
           "peak_concurrency": max(peaks) if peaks else None,
           "device": runs[0]["device"]}
    if mode != "hf":
        out["budget_policy"] = policy
        out.update({k: runs[-1][k] for k in COUNTS})
    return out


def _device_type(config: EngineConfig) -> str:
    from zipage.engine.execution.model_runner import resolve_device

    return resolve_device(config.device).type


def _block_size(config: EngineConfig) -> int:
    """The engine's block size for this config (its default depends on the device)."""
    return config.block_size or (256 if _device_type(config) == "cuda" else 32)


def _load(model: str, modes: list[str], config: EngineConfig, engine_kwargs: dict) -> dict:
    """One runner per mode, all loaded at once so that the timed runs can interleave. Every mode gets
    one pool size: the first engine's, unless the user sized the pool."""
    explicit_pool = config.num_kv_blocks is not None or config.kv_cache_gb is not None
    engines = [m for m in modes if m != "hf"]
    if len(modes) > 1 and not explicit_pool and _device_type(config) == "cuda":
        raise ValueError("on a GPU, size the KV pool with --num-kv-blocks or --kv-cache-gb: bench keeps every "
                         "mode loaded at once, and each would otherwise claim most of the GPU's memory")
    runners, kwargs = {}, dict(engine_kwargs)
    try:
        for mode in engines:
            mode_kwargs = dict(kwargs, budget_policy="elastic") if mode == "elastic" else kwargs
            runner = EngineRunner(model, mode_kwargs, compression=mode != "fullkv")
            runners[mode] = runner
            if not explicit_pool:
                kwargs["num_kv_blocks"] = runner.llm.engine.runner.num_blocks
        if "hf" in modes:
            runners["hf"] = HFRunner(config)
    except BaseException:
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
        raise
    return runners


def kv_footprint(prompt_lens: list[int], output_lens: list[int], block_size: int, budget_blocks: int) -> dict:
    """Mean KV blocks a request holds per generated token, with full KV and with Zipage.

    After the decode step that brings a request to k tokens, full KV holds ceil(k / block_size)
    blocks and Zipage at most budget + 1 (the compressed budget plus the block being filled).
    When the pool is what limits concurrency, the ratio of the two means is the most concurrency,
    and so throughput, that compression can buy on this workload.
    """
    import torch

    full = zipage = steps = 0
    cap = budget_blocks + 1
    for p, n in zip(prompt_lens, output_lens):
        lengths = torch.arange(p + 1, p + n, dtype=torch.int64)  # the first token comes from prefill
        blocks = (lengths + block_size - 1) // block_size
        full += int(blocks.sum())
        zipage += int(blocks.clamp(max=cap).sum())
        steps += len(lengths)
    steps = max(steps, 1)
    return {"full_kv_blocks": full / steps, "zipage_blocks": zipage / steps,
            "ratio": full / zipage if zipage else None}


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineRunner:
    """The engine in one mode, driven step by step (rather than `LLM.generate`) to count generated
    tokens as they come and to sample the number of running requests between steps."""

    def __init__(self, model: str, engine_kwargs: dict, compression: bool):
        from zipage.engine.api.llm import LLM

        self.llm = LLM(model, compression=compression, **engine_kwargs)

    def __call__(self, prompts: list[list[int]], output_len: int, report: Callable[[int], None]) -> dict:
        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        first = engine.totals["generated_tokens"]
        counts = {k: engine.totals[k] for k in COUNTS}
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, params)
        tokens, peak, sampled = 0, 0, 0.0
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.token_ids)
            report(engine.totals["generated_tokens"] - first)
            if time.perf_counter() - sampled >= SNAPSHOT_EVERY_S:
                sampled = time.perf_counter()
                peak = max(peak, len(engine.scheduler.running))
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                "peak_concurrency": peak, "device": engine.device_label,
                **{k: engine.totals[k] - counts[k] for k in COUNTS}}

    def close(self) -> None:
        self.llm.close()


def hf_model(config: EngineConfig):
    """A transformers model holding exactly the engine's weights: the checkpoint's tensors for a real
    model, or the engine's own seeded random init for a `random:` preset."""
    import torch

    from transformers import AutoModelForCausalLM

    from zipage.engine.execution.model_runner import resolve_device, resolve_dtype

    source = resolve_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, config.weight_dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype)
    weights = (_random_weights(source.hf_config, config.seed, device, dtype) if source.is_random
               else source.load_weights())
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    tied = bool(getattr(source.hf_config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the transformers model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model.eval()


def _random_weights(hf_config, seed: int, device: torch.device, dtype: torch.dtype):
    """The engine's random init, renamed and split into HF's unfused layout. Built as the engine's
    ModelRunner builds it (same class, device, dtype and seed), so the values match exactly."""
    import torch

    from zipage.engine.execution.models import CausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            ours = CausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    ours.init_random(seed)
    attn = ours.attention_layers[0]
    for name, tensor in ours.state_dict().items():
        if ".qkv_proj." in name:
            q, k, v = tensor.split([attn.q_size, attn.kv_size, attn.kv_size])
            for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield name.replace(".qkv_proj.", f".{proj}."), part
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor


def hf_batching_config(config: EngineConfig, model):
    """Give transformers the KV memory the engine gets: the same explicit pool size or CPU share of
    RAM (left alone, it takes 60% of RAM on a CPU), or the same fraction of GPU memory."""
    from transformers import ContinuousBatchingConfig

    from zipage.engine.execution.model_runner import CPU_KV_CAP_BYTES, CPU_KV_SHARE_OF_RAM, available_ram_bytes
    from zipage.engine.execution.models import head_dim_of

    hf = model.config
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim_of(hf) * model.dtype.itemsize
    if config.num_kv_blocks is not None:
        block_size = _block_size(config)
        budget = config.num_kv_blocks * block_size * per_token
    elif config.kv_cache_gb is not None:
        budget = int(config.kv_cache_gb * (1 << 30))
    elif model.device.type == "cpu":
        budget = min(int(available_ram_bytes() * CPU_KV_SHARE_OF_RAM), CPU_KV_CAP_BYTES)
    else:
        return ContinuousBatchingConfig(max_memory_percent=config.memory_utilization)
    page_size = ContinuousBatchingConfig().page_size
    # The engine's prefill token budget too: left alone, transformers sizes its batch from the pool
    # and can ask for more memory than the machine has.
    return ContinuousBatchingConfig(num_blocks=max(1, budget // (page_size * per_token)),
                                    max_batch_tokens=config.max_num_batched_tokens)


class HFRunner:
    """transformers' continuous batching on the engine's weights. It reports progress only when a
    whole run ends: `generate_batch` returns everything at once."""

    def __init__(self, config: EngineConfig):
        from zipage.engine.execution.cpu_threads import use_cpu_threads

        self.config = config
        if _device_type(config) == "cpu":  # the threads an engine would run
            use_cpu_threads(config.cpu_threads)
        self.model = hf_model(config)

    def __call__(self, prompts: list[list[int]], output_len: int, report: Callable[[int], None]) -> dict:
        import torch

        from transformers import GenerationConfig

        from zipage.engine.execution.cpu_threads import device_label

        model = self.model
        generation = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        start = time.perf_counter()
        with torch.inference_mode():
            # warmup captures CUDA graphs; on a CPU it only costs time
            outputs = model.generate_batch(inputs=prompts, generation_config=generation,
                                           continuous_batching_config=hf_batching_config(self.config, model),
                                           warmup=model.device.type == "cuda")
        seconds = time.perf_counter() - start
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        report(tokens)
        failed = [o.error for o in outputs.values() if o.error]
        if failed or len(outputs) != len(prompts):
            raise RuntimeError(f"transformers generate_batch failed for "
                               f"{len(prompts) - len(outputs) + len(failed)} requests: {failed[:1]} "
                               "(a smaller pool, --num-kv-blocks or --kv-cache-gb, may fit)")
        return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                "peak_concurrency": None, "device": device_label(model.device)}
