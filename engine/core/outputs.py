"""What a request gives back after a step (`RequestOutput`), and the refusal of a prompt too long
to run (`PromptTooLong`). Every front door hands callers these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One request after a step. A finished output holds everything (prompt and output ids, full
    text); a streaming one holds the new piece (`delta`, `new_token_ids`) and the text so far, so
    that a step costs the same however long the answers grow."""

    id: int
    session: str | None
    prompt_token_ids: list[int]  # complete when finished, else empty
    token_ids: list[int]  # all output ids when finished, else empty
    text: str
    delta: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    new_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0


class PromptTooLong(ValueError):
    """A prompt that cannot run here: it leaves no room for a generated token within max_model_len or
    the whole KV pool. (OpenAI's API calls this context_length_exceeded.)"""
