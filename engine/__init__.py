"""Zipage: an LLM inference engine whose KV cache per request stays bounded."""

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.core import RequestOutput
from zipage.engine.events import EngineSnapshot
from zipage.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "EngineSnapshot", "RequestOutput"]

