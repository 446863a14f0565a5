"""How likely each answer token was, in the console's terms: shading levels by probability, and the
words and numbers the probability view shows for one token. Pure functions of the engine's
`TokenLogprobs` (zipage.engine.logprobs; docs/design-notes.md, "Log-probabilities")."""

from __future__ import annotations

import math
from typing import Callable

from zipage.engine.logprobs import TokenLogprobs
from zipage.cli.console.widgets import printable

# How likely the model found the token it gave, under its raw distribution: under 10%, 10 to 50%, 50 to
# 90%, 90% or more. Each has a colour, a text style and a glyph in every theme.
LEVELS = ("rare", "unsure", "likely", "sure")
BOUNDS = {"sure": 0.9, "likely": 0.5, "unsure": 0.1}  # the lowest probability of each level but the last
LEVEL_LABELS = {"rare": "under 10%", "unsure": "10–50%", "likely": "50–90%", "sure": "90% or more"}
SHORT_LABELS = {"rare": "<10%", "unsure": "10–50%", "likely": "50–90%", "sure": "≥90%"}
GLYPHS = {"rare": "·", "unsure": "░", "likely": "▓", "sure": "█"}  # the legend reads without colour too
BAR_CELLS = 20  # width of an alternative's probability bar


def probability(logprob: float) -> float:
    return math.exp(logprob)


def level(logprob: float) -> str:
    p = probability(logprob)
    return next((name for name in ("sure", "likely", "unsure") if p >= BOUNDS[name]), "rare")


def percent(p: float) -> str:
    """A probability as a short percentage: "93%", "4.2%", "0.031%", "<0.001%"."""
    value = 100 * p
    if value >= 10:
        return f"{value:.0f}%"
    if value >= 0.001:
        return f"{value:.2g}%" if value < 1 else f"{value:.1f}%"
    return "<0.001%"


def summary(entries: list[TokenLogprobs]) -> str:
    """One line over an answer: tokens, how many at each level, the mean logprob and the perplexity."""
    if not entries:
        return "no tokens yet"
    counts = {name: 0 for name in LEVELS}
    for entry in entries:
        counts[level(entry.logprob)] += 1
    mean = sum(e.logprob for e in entries) / len(entries)
    spread = ", ".join(f"{counts[name]} {SHORT_LABELS[name]}" for name in reversed(LEVELS) if counts[name])
    return (f"{len(entries)} token{'s' if len(entries) != 1 else ''} ({spread}) · mean logprob {mean:.3f} · "
            f"perplexity {math.exp(-mean):.3g}")


def shown(token_id: int, text: str | None) -> str:
    """A token for the reader: its text quoted (so spaces and newlines show), or its id where unknown."""
    return repr(printable(text)) if text is not None else f"id {token_id}"


def token_line(entry: TokenLogprobs, index: int, text: str | None) -> str:
    """The selected token: its place, text, logprob, probability and rank."""
    said = " " + shown(entry.token_id, text)
    rank = "the most likely token" if entry.rank == 1 else f"rank {entry.rank}: {entry.rank - 1} token" + (
        "s were" if entry.rank > 2 else " was") + " more likely"
    return (f"answer token {index + 1}{said} · logprob {entry.logprob:.4f} · "
            f"probability {percent(probability(entry.logprob))} · {rank}")


def alternatives(entry: TokenLogprobs, text_of: Callable[[int], str | None]
                 ) -> list[tuple[int, str | None, float, bool]]:
    """The most likely tokens at the selected token's place, most likely first: (id, text or None where
    unknown, logprob, whether it is the token given). The token given comes last when it is not among them."""
    rows = [(t, text_of(t), lp, t == entry.token_id) for t, lp in entry.top.items()]
    if entry.token_id not in entry.top:
        rows.append((entry.token_id, text_of(entry.token_id), entry.logprob, True))
    return rows


def bar(p: float, cells: int = BAR_CELLS) -> str:
    """A probability as a bar of full and empty cells."""
    filled = round(max(0.0, min(1.0, p)) * cells)
    return "█" * filled + "░" * (cells - filled)
