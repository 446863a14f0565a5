"""What a request gives back after a step (`RequestOutput`), the refusal of a prompt too long to run
(`PromptTooLong`), and of a question about a request the engine does not hold (`UnknownRequest`).
Every front door hands callers these."""

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
    # Only where SamplingParams asked for them (docs/design-notes.md, "Log-probabilities"): one
    # TokenLogprobs (zipage.engine.logprobs) per output token when finished, else None; one per new
    # token, beside new_token_ids; and one per prompt token (None for the first, which nothing
    # predicts) on the request's first output and on its finished one.
    logprobs: list | None = None
    new_logprobs: list | None = None
    prompt_logprobs: list | None = None


class PromptTooLong(ValueError):
    """A prompt that cannot run here: it leaves no room for a generated token within max_model_len or
    the whole KV pool. (OpenAI's API calls this context_length_exceeded.)"""


class UnknownRequest(KeyError):
    """A request id the engine does not hold: never submitted there, or already finished. Every door's
    `kept` raises it (the server answers 404)."""

    def __str__(self) -> str:  # the message itself, not KeyError's quoted repr of it
        return str(self.args[0]) if self.args else ""
