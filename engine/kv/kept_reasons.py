"""Why each entry a request holds is still there: a `KeptMap` from the positions read off the device
(docs/design-notes.md, "What a request still holds").

A request's entries stay in token order in its blocks (compaction keeps the order, decoding appends),
so the place of an entry says how its last compression kept it: that compaction put its kept entries
first, the `leading` ones it kept outright at the front and the `newest` ones at the end of those, and
the scores chose the ones between. Entries no compression has decided on (the request was never
compressed, or they were written since) are held because nothing has evicted them yet.
"""

from __future__ import annotations

import math

import torch

from zipage.engine.kv.kept import REASONS, KeptMap

SINK, RECENT, PROMPT, SCORE = (REASONS.index(r) for r in ("sink", "recent", "prompt", "score"))


def kept_map(request_id: int, num_positions: int, compressions: int, positions: torch.Tensor,
             choices: torch.Tensor | None, *, prompt_tokens: int, sink_tokens: int, compacted: int = 0,
             protected: tuple[int, int] = (0, 0), by_recency: bool = False) -> KeptMap:
    """The KeptMap of one request.

    positions, choices: [layers, entries, kv_heads] on the host, the request's entries in cache order:
    each one's token position, and the score that ranked it when it was last kept (None: no
    compression ever ran). `compacted`: the leading entries that came out of the last compaction (0
    if none did), of which `protected` = (leading, newest) were kept outright (`CompressionJob.kept`).
    `by_recency`: the "recent" baseline ranked the others by their age, not by a score.

    Reasons: positions below `sink_tokens` are "sink". Of the compacted entries, the leading ones past
    the sinks are "prompt" (a prompt kept whole), the newest "recent", and the rest "score" with the
    score that chose them. An entry no compression has decided on is "prompt" if it is a prompt token,
    else "recent".
    """
    pos = positions.permute(0, 2, 1).to(torch.int64)  # [layers, kv_heads, entries]
    index = torch.arange(pos.shape[-1])
    lead, newest = protected
    compacted_part = index < compacted
    code = torch.where(pos < prompt_tokens, PROMPT, RECENT)  # nothing evicted it yet
    code = torch.where(compacted_part & (index < lead), PROMPT, code)
    chosen = compacted_part & (index >= lead) & (index < compacted - newest)
    code = torch.where(chosen, RECENT if by_recency else SCORE, code)
    code = torch.where(compacted_part & (index >= compacted - newest), RECENT, code)
    code = torch.where(pos < sink_tokens, SINK, code)
    if choices is None:
        scores = torch.full(pos.shape, math.nan)
    else:
        scores = torch.where(code == SCORE, choices.permute(0, 2, 1).float(), math.nan)
    return KeptMap(
        request_id=request_id, num_positions=num_positions, compressions=compressions, positions=pos.tolist(),
        reasons=[[[REASONS[c] for c in head] for head in layer] for layer in code.tolist()],
        scores=[[[None if s != s else s for s in head] for head in layer] for layer in scores.tolist()])
