"""Next-token choice: greedy, temperature, top-k, top-p, min-p, repetition, frequency and presence penalties,
grammar masks (structured output), per-request seeds."""

from __future__ import annotations

import torch

from zipage.engine.config import SamplingParams
from zipage.engine.execution.grammar_masks import mask_rows
from zipage.engine.execution.penalties import apply_count_penalties


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor on `device` without a host sync: staged in pinned memory on CUDA."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """Push down every token already in the context (prompt and output), as CTRL defines it."""
    if penalty == 1.0 or not token_ids:
        return logits
    ids = upload(sorted(set(token_ids)), logits.device)
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
    """Samples on the logits' device; the host waits only for the one copy of the chosen ids.

    A sampled row takes argmax(probs / E) with E ~ Exponential(1) per token, which picks token i with
    probability probs[i] (the exponential race), so no host-side multinomial is needed. The noise of
    each row comes from a seed drawn on the host from the request's own generator (or the engine's),
    so a seeded request reproduces on its device whatever else shares the batch."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def _device_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device)
        return self._device_generators[device]

    def sample(self, logits: torch.Tensor, requests: list[tuple[SamplingParams, list[int], torch.Generator | None]],
               prompt_lens: list[int] | None = None, masks: tuple[list[int], torch.Tensor] | None = None) -> list[int]:
        """logits [batch, vocab] (float32, CPU or GPU); one (params, context ids, generator) per row.
        `prompt_lens`: how many of each row's context ids are its prompt (None: none are). `masks`:
        (rows, int32 bitmask per row on the host) of the rows a grammar constrains (grammar_masks.py)."""
        return self.sample_on_device(logits, requests, prompt_lens, masks).tolist()

    def sample_on_device(self, logits: torch.Tensor,
                         requests: list[tuple[SamplingParams, list[int], torch.Generator | None]],
                         prompt_lens: list[int] | None = None,
                         masks: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The chosen id of every row as an int64 tensor on the logits' device, without a host sync:
        the caller copies it to the host when it needs the ids."""
        logits = logits.float()
        if masks is not None:  # a new tensor: the caller's logits stay raw for log-probabilities
            logits = mask_rows(logits, *masks)
        penalised = [i for i, (p, _, _) in enumerate(requests) if p.repetition_penalty != 1.0]
        if penalised:
            logits = logits.clone()
            for i in penalised:
                params, context, _ = requests[i]
                logits[i] = apply_repetition_penalty(logits[i], context, params.repetition_penalty)
        counted = [i for i, (p, _, _) in enumerate(requests) if p.frequency_penalty or p.presence_penalty]
        if counted:  # these count the output only: each row's context past its prompt
            starts = prompt_lens or [0] * len(requests)
            logits = apply_count_penalties(logits, counted, [requests[i][0] for i in counted],
                                           [requests[i][1][starts[i]:] for i in counted])
        choice = logits.argmax(-1)  # greedy rows; sampled rows are overwritten below
        sampled = [i for i, (p, _, _) in enumerate(requests) if not p.greedy]
        if not sampled:
            return choice
        probs = torch.stack([filter_logits(logits[i], requests[i][0]) for i in sampled]).softmax(-1)
        noise = torch.empty_like(probs)
        device_gen = self._device_generator(logits.device)
        for row, i in enumerate(sampled):
            seed = int(torch.randint(0, 1 << 62, (1,), generator=requests[i][2] or self.generator))
            noise[row].exponential_(generator=device_gen.manual_seed(seed))
        return choice.index_copy(0, upload(sampled, logits.device), (probs / noise).argmax(-1))
