"""Every EngineConfig field as a command-line option, added to a command by one decorator."""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING, fields

import typer

from zipage.engine.config import EngineConfig

# Help text per knob; fields not listed get a generic line.
KNOB_HELP = {
    "model": "Model: a built-in name (smollm2-135m), a .gguf file, an HF folder, a hub id, or random:PRESET.",
    "device": "cpu or cuda (default: cuda when available).",
    "compression": "Bound each request's KV cache (off = full-KV baseline).",
    "block_size": "Tokens per KV block (default 256 on GPU, 32 on CPU).",
    "max_cache_blocks_per_seq": "Block budget n per request; a request holds at most n + 1 blocks.",
    "window": "Observation window w: queries of the last w positions score the cache.",
    "kv_cache_gb": "Size the KV pool explicitly, in GiB.",
    "num_kv_blocks": "Size the KV pool explicitly, in blocks.",
    "max_num_seqs": "Most requests running at once.",
    "max_model_len": "Longest prompt + output, in tokens.",
    "tensor_parallel_size": "Processes (one per GPU) that share the model's heads and MLP columns.",
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
        option = typer.Option(None, *decl, help=KNOB_HELP.get(f.name, f"Engine knob {f.name} (default {default})."),
                              rich_help_panel=ENGINE_PANEL, show_default=False)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=typing.Optional[typ]))
        names.append(f.name)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        engine_kwargs = {n: kwargs.pop(n) for n in names if kwargs.get(n) is not None}
        return func(*args, engine_kwargs=engine_kwargs, **{k: v for k, v in kwargs.items() if k not in names})

    wrapper.__signature__ = sig.replace(parameters=params)
    return wrapper
