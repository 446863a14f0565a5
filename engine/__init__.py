"""Zipage: an LLM inference engine whose KV cache per request stays bounded."""

import importlib

# Imported on first use (PEP 562): the command line reads the config without loading torch.
_PUBLIC = {"LLM": "zipage.engine.api.llm", "EngineThread": "zipage.engine.api.thread", "SamplingParams": "zipage.engine.config",
           "EngineConfig": "zipage.engine.config", "EngineSnapshot": "zipage.engine.events",
           "RequestOutput": "zipage.engine.core.outputs", "PromptTooLong": "zipage.engine.core.outputs",
           "TokenLogprobs": "zipage.engine.logprobs"}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'zipage.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)

