"""`zipage bench`: throughput of Zipage, the same engine with full KV, and transformers' continuous
batching, on the same weights and the same random-token prompts (greedy, fixed output length).

`run_bench` is the reusable entry point; `kv_footprint` gives the concurrency gain a workload allows.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

import torch

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.llm import LLM
from zipage.engine.loader import resolve_model

MODES = ("zipage", "fullkv", "hf")
SNAPSHOT_EVERY_S = 0.1  # how often a run samples the running-request count

# progress(mode, requests finished, requests total)
Progress = Callable[[str, int, int], None]


def random_prompts(vocab_size: int, num_requests: int, input_len: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_requests, input_len), generator=gen).tolist()


def run_bench(model: str, modes: list[str], num_requests: int, input_len: int, output_len: int,
              engine_kwargs: dict | None = None, progress: Progress | None = None) -> dict:
    """Run each mode in turn on the same prompts; returns the settings and one result per mode
    (`tokens_per_s`, `seconds`, `output_tokens`, `peak_concurrency`, `ratio` to the first mode)."""
    engine_kwargs = dict(engine_kwargs or {})
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if not modes:
        raise ValueError("give at least one mode")
    for name, value in (("num_requests", num_requests), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    engine_kwargs.pop("model", None)
    engine_kwargs.pop("compression", None)  # the mode decides
    config = EngineConfig.from_kwargs(model, **engine_kwargs)  # validates the knobs before any load
    vocab = resolve_model(model).hf_config.vocab_size
    prompts = random_prompts(vocab, num_requests, input_len, config.seed)
    results = []
    for mode in modes:
        report = (lambda done, m=mode: progress(m, done, num_requests)) if progress else (lambda done: None)
        if mode == "hf":
            result = _run_hf(config, prompts, output_len, report)
        else:
            result = _run_engine(model, engine_kwargs, mode == "zipage", prompts, output_len, report)
        result["mode"] = mode
        results.append(result)
        _release_memory()  # the next mode sizes its KV pool from the memory left free
    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio"] = r["tokens_per_s"] / base if base else None
    block_sizes = [r["block_size"] for r in results if r.get("block_size")]
    footprint = (kv_footprint([input_len] * num_requests, [output_len] * num_requests, block_sizes[0],
                              config.max_cache_blocks_per_seq) if block_sizes else None)
    return {"model": model, "num_requests": num_requests, "input_len": input_len, "output_len": output_len,
            "device": results[0].get("device"), "results": results, "kv_footprint": footprint}


def kv_footprint(prompt_lens: list[int], output_lens: list[int], block_size: int, budget_blocks: int) -> dict:
    """Mean KV blocks a request holds per generated token, with full KV and with Zipage.

    After the decode step that brings a request to k tokens, full KV holds ceil(k / block_size)
    blocks and Zipage at most budget + 1 (the compressed budget plus the block being filled).
    When the pool is what limits concurrency, the ratio of the two means is the most concurrency,
    and so throughput, that compression can buy on this workload.
    """
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
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_engine(model: str, engine_kwargs: dict, compression: bool, prompts: list[list[int]], output_len: int,
                report: Callable[[int], None]) -> dict:
    """Drive the engine step by step (rather than `LLM.generate`) to sample progress and the number of
    running requests between steps."""
    llm = LLM(model, compression=compression, **engine_kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        for p in prompts:
            llm.engine.add_request(p, params)
        done, tokens, peak, sampled = 0, 0, 0, 0.0
        while llm.engine.has_work():
            for out in llm.engine.step():
                if out.finished:
                    done += 1
                    tokens += len(out.token_ids)
                    report(done)
            if time.perf_counter() - sampled >= SNAPSHOT_EVERY_S:
                sampled = time.perf_counter()
                peak = max(peak, llm.snapshot().running)
        seconds = time.perf_counter() - start
        device = llm.snapshot().device
        block_size = llm.engine.block_size
    finally:
        llm.close()
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "peak_concurrency": peak, "device": device, "block_size": block_size}


def hf_model(config: EngineConfig):
    """A transformers model holding exactly the engine's weights: the checkpoint's tensors for a real
    model, or the engine's own seeded random init for a `random:` preset."""
    from transformers import AutoModelForCausalLM

    from zipage.engine.model_runner import resolve_device, resolve_dtype

    source = resolve_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
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
    from zipage.engine.models import CausalLM

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

    from zipage.engine.model_runner import CPU_KV_CAP_BYTES, CPU_KV_SHARE_OF_RAM, available_ram_bytes
    from zipage.engine.models import head_dim_of

    hf = model.config
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim_of(hf) * model.dtype.itemsize
    if config.num_kv_blocks is not None:
        block_size = config.block_size or (256 if model.device.type == "cuda" else 32)
        budget = config.num_kv_blocks * block_size * per_token
    elif config.kv_cache_gb is not None:
        budget = int(config.kv_cache_gb * (1 << 30))
    elif model.device.type == "cpu":
        budget = min(int(available_ram_bytes() * CPU_KV_SHARE_OF_RAM), CPU_KV_CAP_BYTES)
    else:
        return ContinuousBatchingConfig(max_memory_percent=config.memory_utilization)
    page_size = ContinuousBatchingConfig().page_size
    return ContinuousBatchingConfig(num_blocks=max(1, budget // (page_size * per_token)))


def _run_hf(config: EngineConfig, prompts: list[list[int]], output_len: int, report: Callable[[int], None]) -> dict:
    from transformers import GenerationConfig

    model = hf_model(config)
    generation = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    report(0)
    start = time.perf_counter()
    with torch.inference_mode():
        # warmup captures CUDA graphs; on a CPU it only costs time
        outputs = model.generate_batch(inputs=prompts, generation_config=generation,
                                       continuous_batching_config=hf_batching_config(config, model),
                                       warmup=model.device.type == "cuda")
    seconds = time.perf_counter() - start
    report(len(outputs))
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    failed = [o.error for o in outputs.values() if o.error]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"transformers generate_batch failed for {len(prompts) - len(outputs) + len(failed)} "
                           f"requests: {failed[:1]}")
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "peak_concurrency": None, "device": str(model.device)}
