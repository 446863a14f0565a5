"""Zipage: an LLM inference engine whose KV cache per request stays bounded.

The folders `engine/`, `zipage_kernels/`, `zipage_cli/` and `themes/` of the source tree install as
`zipage.engine`, `zipage.kernels`, `zipage.cli` and `zipage.themes`, so no generic top-level name
(`kernels`, `themes`) is claimed in a user's environment; and the kernels' folder is not `kernels/`,
which from the source tree's root would shadow the installed package of that name (transformers
imports it)."""

import importlib

# Where each public name lives; imported on first use (PEP 562), so that `zipage --help` and
# `zipage models` never pay for importing torch and transformers.
_PUBLIC = {"LLM": "zipage.engine.api.llm", "SamplingParams": "zipage.engine.config",
           "EngineConfig": "zipage.engine.config", "EngineThread": "zipage.engine.api.thread",
           "EngineSnapshot": "zipage.engine.events", "RequestOutput": "zipage.engine.core.outputs",
           "PromptTooLong": "zipage.engine.core.outputs", "TokenLogprobs": "zipage.engine.logprobs"}

__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'zipage' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
