"""Every EngineConfig field as a command-line option, added to a command by one decorator."""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING, fields

import typer

from zipage.engine.config import EngineConfig

# Help text per knob (every EngineConfig field; a test checks none is missing).
KNOB_HELP = {
    "model": "Model: a built-in name (smollm2-135m), a .gguf file, an HF folder, a hub id, or random:PRESET.",
    "device": "cpu or cuda (default: cuda when available).",
    "dtype": "float32, bfloat16 or float16 (default: bfloat16 on GPU, float32 on CPU).",
    "weight_dtype": "auto: a quantized GGUF runs as stored on the CPU (Q4_0/Q4_1/Q4_K/Q5_0/Q6_K/Q8_0 in integer dots); "
                    "float32 or bfloat16: dequantize every weight to that dtype.",
    "kv_cache_dtype": "auto: K and V in the model's dtype; fp8 (float8 e4m3) or int8: codes with a scale per "
                      "entry, half the bytes of bf16, so twice the tokens per GiB.",
    "cpu_threads": "Intra-op threads of the engine on the CPU (default: chosen for the machine).",
    "compression": "Bound each request's KV cache (off = full-KV baseline).",
    "block_size": "Tokens per KV block (default 256 on GPU, 32 on CPU).",
    "max_cache_blocks_per_seq": "Block budget n of a request that names none (its own: kv_budget).",
    "budget_policy": "fixed: a request holds at most budget + 1 blocks; elastic: the budget is a floor, and "
                     "requests keep full KV until the pool is short.",
    "window": "Observation window w: queries of the last w positions score the cache.",
    "use_global_score": "Carry each kept token's score into the next compression (decayed).",
    "global_decay": "Decay of the carried score: s = max(s_now, decay * s_prev).",
    "use_redundancy": "Lower the score of keys that near-duplicate other keys.",
    "redundancy_lambda": "Weight of attention against redundancy in the score (1 = attention only).",
    "redundancy_temperature": "Softmax temperature of the redundancy term.",
    "lightning_redundancy": "Compare keys only within their own block (cheaper redundancy).",
    "enable_pooling": "Max-pool scores along tokens at a request's first compression.",
    "pooling_kernel": "Width of that pooling, in tokens (odd).",
    "num_sink_tokens": "First tokens of a request that are never evicted.",
    "eviction": "What chooses the evicted tokens: score (Zipage), random or recent (baselines).",
    "async_compress": "Compress in the background while the other requests keep decoding.",
    "max_compressions_per_step": "Most compressions started per engine step.",
    "hybrid_scheduling": "Let requests without a query slot keep decoding while they have room.",
    "num_query_slots": "Query slots M (requests that can be scored at once); default sized with the pool.",
    "prefix_caching": "Reuse the KV blocks of a prompt prefix seen before.",
    "max_num_seqs": "Most requests running at once.",
    "max_model_len": "Longest prompt + output, in tokens.",
    "max_num_batched_tokens": "Most tokens one step computes: every decoding request's token first, prefill chunks in the rest.",
    "cpu_step_target_ms": "On the CPU, size prefill chunks from measured step times so a step lasts about this "
                          "long (chat, top and serve: 250; default: the token budget alone).",
    "mixed_steps": "Run prefill chunks in the same steps as decode tokens, so a long prompt never stops the streams.",
    "memory_utilization": "Share of GPU memory for weights and the KV pool.",
    "kv_cache_gb": "Size the KV pool explicitly, in GiB.",
    "num_kv_blocks": "Size the KV pool explicitly, in blocks.",
    "enforce_eager": "Never capture CUDA graphs.",
    "overlap_steps": "Plan each decode step while the device runs the previous one (default: on for CUDA).",
    "tensor_parallel_size": "Processes (one per GPU) that share the model's heads and MLP columns.",
    "seed": "Seed of the engine (random weights, random eviction, unseeded sampling).",
    "recent_share": "While decoding, share of the budget (after a kept prompt) always kept for the newest entries.",
    "prompt_share": "A prompt that fits in this share of the budget is never evicted.",
}
ENGINE_PANEL = "Engine"


def _option_type(field_type: str):
    """Map a dataclass field's annotation string to the type Typer should parse."""
    base = field_type.replace(" ", "").replace("|None", "").replace("Optional[", "").rstrip("]")
    return {"int": int, "float": float, "bool": bool, "str": str}[base]


def engine_options(func):
    """Append every EngineConfig field to `func`'s options; the call receives them as `engine_kwargs`
    (only those the user set, so EngineConfig defaults stay the single source of truth)."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.name != "engine_kwargs"]
    names = []
    for f in fields(EngineConfig):
        typ = _option_type(str(f.type))
        default = f.default if f.default is not MISSING else None
        flag = "--" + f.name.replace("_", "-")
        if typ is bool:
            decl = [f"{flag}/--no-{f.name.replace('_', '-')}"]
        else:
            decl = [flag]
        shown = "" if default is None or typ is bool else f" [default: {default}]"
        option = typer.Option(None, *decl, help=KNOB_HELP.get(f.name, f"Engine setting {f.name}.") + shown,
                              rich_help_panel=ENGINE_PANEL,
                              show_default=False, metavar="" if typ is bool else None)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=typing.Optional[typ]))
        names.append(f.name)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        engine_kwargs = {n: kwargs.pop(n) for n in names if kwargs.get(n) is not None}
        return func(*args, engine_kwargs=engine_kwargs, **{k: v for k, v in kwargs.items() if k not in names})

    wrapper.__signature__ = sig.replace(parameters=params)
    return wrapper
