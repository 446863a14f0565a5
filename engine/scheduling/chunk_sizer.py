"""Prefill chunks sized by time on the CPU: how many prompt tokens a step may take so that it lasts
about a target time, learned from the steps measured so far (docs/design-notes.md, "Scheduling").

A CPU is 10x slower on one machine than another, and slower still while other jobs share it, so a
fixed token budget that suits one leaves the streams of another waiting for seconds. The estimate
is seconds per token of the steps that prefilled (their decode tokens counted in), smoothed over
recent steps; it grows as a long prompt's chunks attend to more context, and the chunks shrink with
it. On a GPU a step of `max_num_batched_tokens` is already short, and step times there are not
known until a step is read, so the sizer is not used.
"""

from __future__ import annotations

MIN_CHUNK = 16  # a prompt always advances, however slow the machine
SMOOTHING = 0.5  # weight of the newest step in the estimate: chunks follow a growing context quickly


class ChunkSizer:
    def __init__(self, target_s: float | None):
        self.target_s = target_s  # None: time does not limit the chunks
        self.seconds_per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that prefilled computed `tokens` in all and took `seconds`."""
        if self.target_s is None or tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old

    def limit(self, decoders: int) -> int | None:
        """The most prompt tokens a step with `decoders` decode tokens may take; None: no limit."""
        if self.target_s is None or self.seconds_per_token is None:
            return None
        return max(MIN_CHUNK, int(self.target_s / self.seconds_per_token) - decoders)
