"""Zipage: an LLM inference engine whose KV cache per request stays bounded."""

from engine.config import EngineConfig, SamplingParams
from engine.core import RequestOutput
from engine.events import EngineSnapshot
from engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "EngineSnapshot", "RequestOutput"]
__version__ = "0.1.0"
