"""What a request's KV still holds, in the console's terms: shading levels, the layer strip's buckets,
one token's reasons layer by layer, and the phrases a compression just dropped. Pure functions of
`KeptMap`s (engine/kv/kept.py) and token texts; the kept view and the teaching notes draw them. The
reasons: docs/design-notes.md, "What a request still holds"."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from zipage.engine.kv.kept import REASONS, KeptMap
from zipage.cli.console.widgets import printable

# How widely a token is still held: by no (layer, KV head) pair, by fewer than half of them, by half or
# more, by all of them. Each has a colour, a text style and a strip glyph in every theme.
LEVELS = ("gone", "partly", "mostly", "all")
LEVEL_LABELS = {"gone": "gone everywhere", "partly": "by under half", "mostly": "by half or more",
                "all": "kept everywhere"}
GLYPHS = {"gone": "·", "partly": "░", "mostly": "▓", "all": "█"}  # the strip reads without colour too


def level(share: float) -> str:
    if share <= 0:
        return "gone"
    if share >= 1:
        return "all"
    return "partly" if share < 0.5 else "mostly"


def layer_shares(kmap: KeptMap) -> list[list[float]]:
    """[layer][position]: the share of that layer's KV heads still holding the position."""
    rows = []
    for layer in kmap.positions:
        counts = [0] * kmap.num_positions
        for head in layer:
            for p in head:
                counts[p] += 1
        rows.append([c / len(layer) if layer else 0.0 for c in counts])
    return rows


def buckets(num_positions: int, cells: int) -> list[range]:
    """Positions split into at most `cells` consecutive, near-equal buckets (one per position if they fit)."""
    cells = max(1, min(cells, num_positions))
    return [range(b * num_positions // cells, (b + 1) * num_positions // cells) for b in range(cells)]


def strip_rows(kmap: KeptMap, cells: int) -> tuple[list[range], list[list[float]]]:
    """The layer strip: its buckets, and per layer the mean share of heads holding each bucket."""
    spans = buckets(kmap.num_positions, cells)
    rows = [[sum(row[p] for p in span) / len(span) for span in spans] for row in layer_shares(kmap)]
    return spans, rows


def _at(sorted_positions: list[int], values: list, position: int):
    i = bisect.bisect_left(sorted_positions, position)
    return values[i] if i < len(sorted_positions) and sorted_positions[i] == position else None


def held_summary(kmap: KeptMap, position: int) -> str:
    """"held by 40 of 90 (layer, head) pairs, in 20 of 30 layers"."""
    pairs = kmap.num_layers * kmap.num_kv_heads
    held = kmap.holders()[position]
    layers = kmap.layers_holding()[position]
    return f"held by {held} of {pairs} (layer, KV head) pairs, in {layers} of {kmap.num_layers} layers"


def reasons_lines(kmap: KeptMap, position: int) -> list[str]:
    """Why each layer's heads hold `position` (or that they evicted it), with the mean score of those
    that hold it by score; consecutive layers that say the same are one line, with the range of their
    scores: "layer 3: sink ×2, score ×6 (0.41)", "layers 4–7: score ×3 (0.064–0.086)", "layers 8–9: evicted ×3"."""
    per_layer = []
    for pos_l, why_l, score_l in zip(kmap.positions, kmap.reasons, kmap.scores):
        counts, scores = Counter(), []
        for pos, why, score in zip(pos_l, why_l, score_l):
            reason = _at(pos, why, position)
            counts[reason or "evicted"] += 1
            value = _at(pos, score, position) if reason == "score" else None
            if value is not None:
                scores.append(value)
        key = tuple((reason, counts[reason]) for reason in (*REASONS, "evicted") if counts[reason])
        per_layer.append((key, sum(scores) / len(scores) if scores else None))
    groups: list[list] = []  # [first layer, last layer, key, mean scores]
    for layer, (key, mean) in enumerate(per_layer):
        if groups and groups[-1][2] == key:
            groups[-1][1] = layer
        else:
            groups.append([layer, layer, key, []])
        if mean is not None:
            groups[-1][3].append(mean)
    lines = []
    for first, last, key, means in groups:
        scores = ""
        if means:
            low, high = f"{min(means):.2g}", f"{max(means):.2g}"
            scores = f" ({low})" if low == high else f" ({low}–{high})"
        words = ", ".join(f"{reason} ×{n}" + (scores if reason == "score" else "") for reason, n in key)
        lines.append(f"layer {first}: {words}" if first == last else f"layers {first}–{last}: {words}")
    return lines


def first_dropped(kmap: KeptMap) -> int:
    """The first position some (layer, head) pair no longer holds, else 0: where the view's cursor starts."""
    return next((p for p, share in enumerate(kmap.share()) if share < 1), 0)


# -- what a compression dropped --------------------------------------------------------------------
def _held_by_layer(kmap: KeptMap, num_positions: int) -> list[set[int]]:
    """Per layer, the positions some head holds; positions written after the map was taken are held by
    every head until the next compression."""
    grown = set(range(kmap.num_positions, num_positions))
    return [set().union(*layer) | grown for layer in kmap.positions]


def _before_and_after(before: KeptMap | None, after: KeptMap) -> tuple[list[set[int]], list[set[int]]]:
    n = after.num_positions
    held_before = [set(range(n)) for _ in after.positions] if before is None else _held_by_layer(before, n)
    return held_before, _held_by_layer(after, n)


def dropped_layers(before: KeptMap | None, after: KeptMap) -> list[int]:
    """For each position of `after`, in how many layers some head held it before the compression and
    none holds it after. `before` is the latest map taken before the compression, None where the
    request had never been compressed (everything was held)."""
    counts = [0] * after.num_positions
    for was, now in zip(*_before_and_after(before, after)):
        for p in was - now:
            if p < after.num_positions:
                counts[p] += 1
    return counts


def left_the_cache(before: KeptMap | None, after: KeptMap) -> int:
    """Positions some layer held before the compression and no layer holds after."""
    was, now = _before_and_after(before, after)
    return len(set().union(*was) - set().union(*now)) if was else 0


@dataclass(frozen=True)
class Phrase:
    start: int  # first position
    end: int  # one past the last
    most: int  # the most layers that dropped one of its tokens
    least: int  # the fewest

    def layers(self, num_layers: int) -> str:
        span = str(self.most) if self.most == self.least else f"{self.least}–{self.most}"
        return f"{span} of {num_layers} layers"


LONGEST_PHRASE = 8  # tokens


def dropped_phrases(counts: list[int], most: int = 3) -> list[Phrase]:
    """The `most` most-dropped phrases: the position dropped in the most layers, grown over its
    neighbours dropped in at least half as many (up to LONGEST_PHRASE tokens); then the next one."""
    used: set[int] = set()
    phrases = []
    for seed in sorted((p for p, c in enumerate(counts) if c), key=lambda p: (-counts[p], p)):
        if seed in used:
            continue
        floor = -(-counts[seed] // 2)

        def joins(p: int) -> bool:
            return 0 <= p < len(counts) and p not in used and counts[p] >= floor

        lo = hi = seed
        while hi - lo + 1 < LONGEST_PHRASE and (joins(lo - 1) or joins(hi + 1)):
            if joins(lo - 1):
                lo -= 1
            if hi - lo + 1 < LONGEST_PHRASE and joins(hi + 1):
                hi += 1
        used.update(range(lo, hi + 1))
        span = counts[lo:hi + 1]
        phrases.append(Phrase(lo, hi + 1, max(span), min(span)))
        if len(phrases) == most:
            break
    return phrases


def phrase_text(phrase: Phrase, pieces: list[str | None] | None, limit: int = 32) -> str:
    """The phrase in quotes ("'magic number'"), or its positions where the token texts are unknown."""
    texts = pieces[phrase.start:phrase.end] if pieces else []
    if len(texts) < phrase.end - phrase.start or any(t is None for t in texts):
        return f"position {phrase.start}" if phrase.end - phrase.start == 1 else \
            f"positions {phrase.start}–{phrase.end - 1}"
    text = printable("".join(texts)).replace("\n", "↵").strip() or "".join(texts).replace(" ", "␣")
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return f"'{text}'"


def dropped_sentence(before: KeptMap | None, after: KeptMap, pieces: list[str | None] | None) -> str | None:
    """What a compression dropped, in words: "Dropped 'magic number' in 14 of 28 layers, ...; 61 positions
    left at least one layer, 12 left the cache entirely." None when no layer lost anything."""
    counts = dropped_layers(before, after)
    lost = sum(1 for c in counts if c)
    if not lost:
        return None
    layers = after.num_layers
    named = ", ".join(f"{phrase_text(p, pieces)} in {p.layers(layers)}" for p in dropped_phrases(counts))
    gone = left_the_cache(before, after)
    return (f"Dropped {named}; {lost} position{'s' if lost != 1 else ''} left at least one layer, "
            f"{gone} left the cache entirely.")
