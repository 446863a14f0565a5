"""Next-token choice: greedy, temperature, top-k, top-p, min-p, repetition, frequency and presence penalties,
grammar masks (structured output), per-request seeds."""

from __future__ import annotations

import torch

from zipage import kernels
from zipage.engine.config import SamplingParams
from zipage.engine.execution.grammar_masks import mask_rows
from zipage.engine.execution.penalties import apply_count_penalties
from zipage.kernels import reference


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `dtype` on `device` without a host sync: staged in pinned memory on CUDA."""
    host = torch.tensor(values, dtype=dtype)
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
    return filtered_logits(logits[None], [0], [params])[0]


def filtered_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """These rows [len(rows), vocab] divided by their temperatures, -inf where their filters drop a
    token: what a sampled row draws from."""
    chosen = logits if rows == list(range(logits.shape[0])) else logits[upload(rows, logits.device)]
    ranked, asks = rank(chosen, params)
    return reference.filtered_rows(chosen, sampling_table(params, [0.0] * len(params), chosen), ranked, asks)


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _top_k(params: SamplingParams, vocab: int) -> int:
    """The row's top-k, vocab where it has none (or one past the vocabulary)."""
    return params.top_k if 0 < params.top_k < vocab else vocab


# The filters look first among each row's likeliest tokens, by topk, rather than sort whole rows.
# Rows whose filters all carry a top-k of at most this many need only their top-k (on an H100 a
# lone row's sort of 151,936 logits cost more than its top-k: docs/benchmarks.md, "Sampling on CUDA in
# three launches"). On the CPU, where a full sort of a 49k vocabulary took 3.3 ms a row and its top
# 1,024 0.4 ms, rows of top-p or min-p look at this many first, as a nucleus rarely holds more. (On
# CUDA asking whether those candidates suffice would wait for the device, so such rows are sorted
# whole there.)
TOP_P_CANDIDATES = 1024


def rank(logits: torch.Tensor, params: list[SamplingParams],
         may_sync: bool | None = None) -> tuple[torch.Tensor | None, tuple[bool, bool, bool, bool]]:
    """The candidates sample_rows needs, [rows, C] largest first (None when no row filters), and its
    `asks`. may_sync (default: off CUDA): sample_rows may find a row's candidates short and sort whole."""
    vocab = logits.shape[-1]
    filtering = [p for p in params if _filters(p)]
    top_k = [_top_k(p, vocab) for p in filtering]
    every_top_k = all(k < vocab for k in top_k)
    asks = (any(k < vocab for k in top_k), any(p.top_p < 1.0 for p in filtering),
            any(p.min_p > 0.0 for p in filtering), every_top_k)
    if not filtering:
        return None, asks
    if may_sync is None:
        may_sync = not logits.is_cuda
    if every_top_k and max(top_k) <= TOP_P_CANDIDATES:
        candidates = max(top_k)
    elif may_sync and all(k < TOP_P_CANDIDATES or k == vocab for k in top_k):
        candidates = min(TOP_P_CANDIDATES, vocab)
    else:
        candidates = vocab
    if candidates == vocab:
        return torch.sort(logits, descending=True)[0], asks
    return torch.topk(logits, candidates)[0], asks


def sampling_table(params: list[SamplingParams], uniforms: list[float], logits: torch.Tensor) -> torch.Tensor:
    """sample_rows' params [rows, 5] (float64, reference.SAMPLING_COLUMNS) on the logits' device,
    in one upload."""
    vocab = logits.shape[-1]
    flat = [x for p, u in zip(params, uniforms) for x in (p.temperature, _top_k(p, vocab), p.top_p, p.min_p, u)]
    return upload(flat, logits.device, torch.float64).view(len(params), len(reference.SAMPLING_COLUMNS))


# One setting for each set of sampling kernels that differ (docs/design-notes.md, "Sampling"):
# temperature alone, top-k alone, top-k with top-p, top-p alone, min-p alone, top-k with min-p.
WARM_UP_SETTINGS = (dict(), dict(top_k=20), dict(top_k=20, top_p=0.9), dict(top_p=0.9), dict(min_p=0.1),
                    dict(top_k=20, min_p=0.1))


class Sampler:
    """Samples on the logits' device; the host waits only for the one copy of the chosen ids.

    A sampled row draws one uniform u in [0, 1) on the host, from the request's own generator (or
    the engine's), and takes the first token whose cumulative probability exceeds u (inverse CDF,
    summed in float64): exact sampling from one number a row, so a seeded request reproduces on its
    device whatever else shares the batch. Drawing a noise value per vocabulary entry instead (the
    exponential race) took ~1 ms a row on a 2-core CPU, a fifth of an 8-session step, and two
    launches a row on CUDA (docs/design-notes.md, "Sampling")."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Draw once from logits [rows, vocab] with each setting of WARM_UP_SETTINGS, so no sampling
        kernel is compiled while a request waits for its first token (1.96 s on a fresh H100); the
        engine's own stream is left as it was."""
        state = self.generator.get_state()
        for setting in WARM_UP_SETTINGS:
            self.sample_on_device(logits, [(SamplingParams(temperature=1.0, **setting), [], None)] * len(logits))
        self.generator.set_state(state)

    def uniforms(self, generators: list[torch.Generator | None]) -> list[float]:
        """One u in [0, 1) a row, from the row's own generator or, for rows without one, from the
        engine's in a single call (the same numbers one call a row would give, in row order: a
        256-row step spent 0.9 ms drawing them one by one)."""
        shared = [i for i, g in enumerate(generators) if g is None]
        drawn = torch.rand(len(shared), dtype=torch.float64, generator=self.generator).tolist() if shared else []
        uniforms = [0.0] * len(generators)
        for i, u in zip(shared, drawn):
            uniforms[i] = u
        for i, g in enumerate(generators):
            if g is not None:
                uniforms[i] = float(torch.rand((), dtype=torch.float64, generator=g))
        return uniforms

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
        sampled = [i for i, (p, _, _) in enumerate(requests) if not p.greedy]
        if not sampled:
            return logits.argmax(-1)
        chosen = logits if len(sampled) == len(requests) else logits[upload(sampled, logits.device)]
        params = [requests[i][0] for i in sampled]
        uniforms = self.uniforms([requests[i][2] for i in sampled])
        ranked, asks = rank(chosen, params)
        picks = kernels.sample_rows(chosen, sampling_table(params, uniforms, chosen), ranked, asks)
        if len(sampled) == len(requests):  # no greedy row: no argmax over the vocabulary
            return picks
        return logits.argmax(-1).index_copy(0, upload(sampled, logits.device), picks)
