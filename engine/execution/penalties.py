"""Frequency and presence penalties: OpenAI's definitions, over each request's output tokens.

logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0), where count(t) is how
often token t appears in the request's output so far (the prompt does not count, as in vLLM). The
counts are built on the logits' device from the output ids, for all penalised rows at once: one
upload, one scatter and one subtraction per step (docs/design-notes.md, "Penalties").
"""

from __future__ import annotations

import itertools

import torch

from zipage.engine.config import SamplingParams


def output_counts(outputs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(outputs), vocab_size] float32: how often each token appears in each output."""
    lengths = torch.tensor([len(ids) for ids in outputs])
    rows = torch.repeat_interleave(torch.arange(len(outputs)), lengths)
    # Each (row, token) as one index into the flattened counts: a single scatter counts every row.
    flat = rows * vocab_size + torch.tensor(list(itertools.chain.from_iterable(outputs)), dtype=torch.long)
    counts = torch.zeros(len(outputs) * vocab_size, device=device)
    counts.index_add_(0, _to_device(flat, device), torch.ones(flat.numel(), device=device))
    return counts.view(len(outputs), vocab_size)


def apply_count_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                          outputs: list[list[int]]) -> torch.Tensor:
    """The logits [batch, vocab] with the rows `rows` penalised, each by its own params' frequency and
    presence penalties and the ids of its output. A new tensor; the input is kept."""
    counts = output_counts(outputs, logits.shape[-1], logits.device)
    scales = torch.tensor([[p.frequency_penalty for p in params], [p.presence_penalty for p in params]])
    frequency, presence = _to_device(scales, logits.device)[:, :, None]
    penalty = frequency * counts + presence * (counts > 0)
    return logits.index_add(0, _to_device(torch.tensor(rows), logits.device), penalty, alpha=-1)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor on `device` without a host sync: staged in pinned memory on CUDA."""
    return host if device.type != "cuda" else host.pin_memory().to(device, non_blocking=True)
