"""Zipage: an LLM inference engine whose KV cache per request stays bounded.

The folders `engine/`, `kernels/`, `zipage_cli/` and `themes/` of the source tree install as
`zipage.engine`, `zipage.kernels`, `zipage.cli` and `zipage.themes`, so no generic top-level name
(`kernels`, `themes`) is claimed in a user's environment."""

from zipage.engine import LLM, EngineConfig, EngineSnapshot, RequestOutput, SamplingParams
from zipage.engine.service import EngineThread

__all__ = ["LLM", "SamplingParams", "EngineConfig", "EngineThread", "EngineSnapshot", "RequestOutput"]
__version__ = "0.1.0"
