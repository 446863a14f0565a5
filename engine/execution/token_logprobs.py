"""Log-probabilities on the device, for the requests that ask (docs/design-notes.md, "Log-probabilities").

Each row's logits are reduced where they are to what was asked: the logprob and rank of one token and
the k most likely tokens, packed as one float32 row [logprob, rank, k logprobs, k ids] (ranks and ids
below 2**24 are exact in float32). One step's rows travel to the host in one copy, beside its ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zipage.engine.execution.sampler import upload
from zipage.engine.logprobs import TokenLogprobs

PROMPT_ROWS_AT_ONCE = 256  # prompt rows whose logits exist at once: a long chunk's all would not fit


def reduce_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 2 + 2k] float32: per row of `logits` [rows, vocab], its target's logprob and rank, then the
    k highest logprobs and their token ids, most likely first."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, targets.view(-1, 1))
    ranks = (logprobs > chosen).sum(-1, keepdim=True) + 1
    top = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, ranks.float(), top.values, top.indices.float()], dim=1)


def unpack_rows(rows: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """The host rows of `reduce_rows` as records, each row with its own k (at most the k reduced)."""
    width = (rows.shape[1] - 2) // 2
    out = []
    for row, target, k in zip(rows.tolist(), targets, ks):
        top = dict(zip((int(t) for t in row[2 + width:2 + width + k]), row[2:2 + k]))
        out.append(TokenLogprobs(target, row[0], int(row[1]), top))
    return out


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """The rows' host copy: on CUDA into pinned memory without waiting (ready once the step's event
    is), elsewhere the rows themselves."""
    if rows.device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    return host.copy_(rows, non_blocking=True)


@dataclass
class PromptScoring:
    """The prompt positions one forward scores: for each request asking prompt logprobs whose chunk
    holds positions it has not scored yet, the logprob of the token after each of them."""

    seqs: list = field(default_factory=list)  # (sequence, first position scored, how many)
    rows: list[int] = field(default_factory=list)  # their rows in the forward's tokens
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    ks: list[int] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)  # reduced rows, in order, on the device
    host: torch.Tensor | None = None

    @classmethod
    def plan(cls, batch) -> "PromptScoring | None":
        """What this batch's chunks score, or None. Only prefill chunks compute prompt positions, so a
        decode step costs nothing here."""
        if not batch.is_prefill:
            return None
        scoring, offset = cls(), sum(batch.num_new_tokens[:batch.num_decode])
        for i in range(batch.num_decode, len(batch.seqs)):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                first, end = max(start, seq.prompt_scored), min(start + n, seq.num_prompt_tokens - 1)
                if first < end:
                    scoring.seqs.append((seq, first, end - first))
                    scoring.rows += range(offset + first - start, offset + end - start)
                    scoring.targets += seq.token_ids[first + 1:end + 1]
                    scoring.ks += [seq.params.prompt_logprobs] * (end - first)
            offset += n
        return scoring if scoring.rows else None

    def reduce(self, logits: torch.Tensor, start: int) -> None:
        """Logits of rows[start:start + len(logits)], reduced on their device."""
        targets = upload(self.targets[start:start + logits.shape[0]], logits.device)
        self.parts.append(reduce_rows(logits, targets, max(self.ks)))

    def copy_to_host(self) -> None:
        self.host = to_host(torch.cat(self.parts))
        self.parts = []

    def record(self) -> None:
        """Once the step's copies are done: each request's prompt logprobs take their places."""
        entries = unpack_rows(self.host, self.targets, self.ks)
        done = 0
        for seq, first, count in self.seqs:
            seq.record_prompt_logprobs(first, entries[done:done + count])
            done += count
