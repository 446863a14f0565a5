"""Which token positions a request's KV cache still holds, per layer and KV head, and why each was
kept (docs/design-notes.md, "What a request still holds"). Plain Python: the engine builds a
`KeptMap` on demand, servers send it as JSON, consoles draw it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Why an entry is still held: one of the oldest entries a compression always keeps, one of the
# newest ones kept outright, part of a prompt kept whole, or chosen by its score.
REASONS = ("sink", "recent", "prompt", "score")


@dataclass(frozen=True)
class KeptMap:
    request_id: int
    num_positions: int  # token positions whose KV has been written (0 .. num_positions - 1)
    compressions: int  # compressions the request has had when asked
    positions: list[list[list[int]]]  # [layer][kv_head]: sorted positions held
    reasons: list[list[list[str]]]  # same shape: one of REASONS per held position
    scores: list[list[list[float | None]]]  # same shape: the score that chose it, None unless "score"

    def __post_init__(self):
        for layer, (pos_l, why_l, sc_l) in enumerate(zip(self.positions, self.reasons, self.scores)):
            if not (len(pos_l) == len(why_l) == len(sc_l)):
                raise ValueError(f"layer {layer}: heads differ in number across positions/reasons/scores")
            for head, (pos, why, sc) in enumerate(zip(pos_l, why_l, sc_l)):
                if not (len(pos) == len(why) == len(sc)):
                    raise ValueError(f"layer {layer} head {head}: positions, reasons and scores differ in length")
                if any(b <= a for a, b in zip(pos, pos[1:])):
                    raise ValueError(f"layer {layer} head {head}: positions must be sorted and unique")
                if pos and not (0 <= pos[0] and pos[-1] < self.num_positions):
                    raise ValueError(f"layer {layer} head {head}: a position lies outside 0..{self.num_positions - 1}")
                bad = set(why) - set(REASONS)
                if bad:
                    raise ValueError(f"layer {layer} head {head}: unknown reasons {sorted(bad)}")

    @property
    def num_layers(self) -> int:
        return len(self.positions)

    @property
    def num_kv_heads(self) -> int:
        return len(self.positions[0]) if self.positions else 0

    def holders(self) -> list[int]:
        """For each position, how many (layer, kv head) pairs still hold it."""
        counts = [0] * self.num_positions
        for layer in self.positions:
            for head in layer:
                for p in head:
                    counts[p] += 1
        return counts

    def share(self) -> list[float]:
        """For each position, the share of (layer, kv head) pairs that still hold it (0 gone, 1 kept everywhere)."""
        pairs = self.num_layers * self.num_kv_heads
        return [c / pairs if pairs else 0.0 for c in self.holders()]

    def layers_holding(self) -> list[int]:
        """For each position, the number of layers in which at least one KV head holds it."""
        counts = [0] * self.num_positions
        for layer in self.positions:
            held = set()
            for head in layer:
                held.update(head)
            for p in held:
                counts[p] += 1
        return counts

    def reasons_at(self, position: int) -> list[list[str | None]]:
        """[layer][kv_head]: why that head holds `position`, or None where it was evicted."""
        out = []
        for pos_l, why_l in zip(self.positions, self.reasons):
            row = []
            for pos, why in zip(pos_l, why_l):
                row.append(_lookup(pos, why, position))
            out.append(row)
        return out

    def to_dict(self) -> dict:
        return dict(request_id=self.request_id, num_positions=self.num_positions,
                    compressions=self.compressions, positions=self.positions, reasons=self.reasons,
                    scores=self.scores)

    @classmethod
    def from_dict(cls, data: dict) -> "KeptMap":
        return cls(request_id=data["request_id"], num_positions=data["num_positions"],
                   compressions=data["compressions"], positions=data["positions"],
                   reasons=data["reasons"], scores=data["scores"])


def _lookup(sorted_positions: list[int], values: list, position: int):
    i = bisect.bisect_left(sorted_positions, position)
    if i < len(sorted_positions) and sorted_positions[i] == position:
        return values[i]
    return None
