"""Next-token choice: greedy, temperature, top-k, top-p, min-p, repetition penalty, per-request seeds."""

from __future__ import annotations

import torch

from zipage.engine.config import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """Push down every token already in the context (prompt and output), as CTRL defines it."""
    if penalty == 1.0 or not token_ids:
        return logits
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    picked = logits.gather(-1, ids)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, ids, picked)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks on one row of logits."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens above it already reach top_p; the first always stays.
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[..., 0] = False  # however small top_p is (even below float32's range)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[tuple[SamplingParams, list[int], torch.Generator | None]]
               ) -> list[int]:
        """logits [batch, vocab] (float32, CPU or GPU); one (params, context ids, generator) per row."""
        logits = logits.float()
        penalised = [i for i, (p, _, _) in enumerate(requests) if p.repetition_penalty != 1.0]
        if penalised:
            logits = logits.clone()
            for i in penalised:
                params, context, _ = requests[i]
                logits[i] = apply_repetition_penalty(logits[i], context, params.repetition_penalty)
        choice = logits.argmax(-1).tolist()  # greedy rows; sampled rows are overwritten below
        for i, (params, _, generator) in enumerate(requests):
            if params.greedy:
                continue
            probs = filter_logits(logits[i], params).softmax(-1).cpu()
            choice[i] = int(torch.multinomial(probs, 1, generator=generator or self.generator))
        return choice
