"""Next-token choice: greedy, temperature, top-k, top-p, min-p, repetition, frequency and presence penalties,
grammar masks (structured output), per-request seeds."""

from __future__ import annotations

import torch

from zipage.engine.config import SamplingParams
from zipage.engine.execution.grammar_masks import mask_rows
from zipage.engine.execution.penalties import apply_count_penalties


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


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


# On the CPU the filters look first among this many most likely tokens: a full sort of a 49k
# vocabulary took 3.3 ms a row on a 2-core CPU, the top 1,024 0.4 ms, and a nucleus rarely holds
# more. (On CUDA one sort of all rows is cheap, and asking whether the candidates suffice would
# wait for the device.)
TOP_P_CANDIDATES = 1024


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The top-k, top-p and min-p masks (in that order) on rows [rows, vocab] already divided by
    their temperatures, all rows at once: each row ranked once, most likely first."""
    rows, vocab = logits.shape
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    device, dtype = logits.device, logits.dtype
    top_k_t = upload(top_k, device)
    top_p = upload([p.top_p for p in params], device, dtype)
    min_p = upload([p.min_p for p in params], device, dtype)
    # which filters any row asks for: the others are skipped (a lone row on CUDA pays only for its own)
    asks = (any(k < vocab for k in top_k), any(p.top_p < 1.0 for p in params), any(p.min_p > 0.0 for p in params))
    if not logits.is_cuda and vocab > TOP_P_CANDIDATES and all(k < TOP_P_CANDIDATES or k == vocab for k in top_k):
        values, order = torch.topk(logits, TOP_P_CANDIDATES)
        # probabilities over the whole row where no top-k cut it to the candidates
        whole = torch.logsumexp(logits, -1)[:, None]
        values = _mask_ranked(values, top_k_t, top_p, min_p, asks, upload([k == vocab for k in top_k], device, torch.bool),
                              whole)
        if bool(torch.isinf(values[:, -1]).all()):  # every row dropped a candidate: all later tokens go too
            return torch.full_like(logits, float("-inf")).scatter(-1, order, values)
    values, order = torch.sort(logits, descending=True)
    values = _mask_ranked(values, top_k_t, top_p, min_p, asks)
    return logits.scatter(-1, order, values)


def _mask_ranked(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 asks: tuple[bool, bool, bool], whole_row: torch.Tensor | None = None,
                 normaliser: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of logits ranked most likely first (all of a row, or its leading candidates) with
    -inf where top-k, top-p or min-p drops a token. top-k keeps ties with the k-th logit; top-p
    drops a token when the more likely ones already reach top_p (the first always stays); min-p
    drops a token less likely than min_p times the most likely one. Top-p's probabilities are a
    softmax over what top-k kept, or, for candidates of rows top-k left whole (whole_row), against
    the whole row's normaliser (its logsumexp). asks: whether any row has a top-k, a top-p, a min-p."""
    asks_top_k, asks_top_p, asks_min_p = asks
    if asks_top_k:
        kth = values.gather(-1, (top_k - 1).clamp(max=values.shape[-1] - 1)[:, None])
        values = values.masked_fill(values < kth, float("-inf"))
    if asks_top_p:
        probs = values.softmax(-1)
        if normaliser is not None:
            probs = torch.where(whole_row[:, None], (values - normaliser).exp(), probs)
        kept = (probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)
        kept[:, 0] = True  # however small top_p is (even below float32's range)
        values = values.masked_fill(kept.logical_not(), float("-inf"))
    if asks_min_p:
        probs = values.softmax(-1)
        values = values.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return values


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
        probs = filtered_logits(logits, sampled, [requests[i][0] for i in sampled]).softmax(-1)
        uniforms = [float(torch.rand((), dtype=torch.float64, generator=requests[i][2] or self.generator))
                    for i in sampled]
        picks = inverse_cdf(probs, uniforms)
        if len(sampled) == len(requests):  # no greedy row: no argmax over the vocabulary
            return picks
        return logits.argmax(-1).index_copy(0, upload(sampled, logits.device), picks)


def filtered_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """filter_logits of these rows, [len(rows), vocab], all at once."""
    temperatures = upload([p.temperature for p in params], logits.device, logits.dtype)
    chosen = logits if rows == list(range(logits.shape[0])) else logits[upload(rows, logits.device)]
    scaled = chosen / temperatures[:, None]
    filtered = [row for row, p in enumerate(params) if _filters(p)]
    if len(filtered) == len(params):  # every row filtered: no gather, no copy back
        return filter_rows(scaled, params)
    if filtered:
        index = upload(filtered, logits.device)
        scaled = scaled.index_copy(0, index, filter_rows(scaled[index], [params[row] for row in filtered]))
    return scaled


def inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """For each row of probs [rows, vocab], the first token whose cumulative probability (float64)
    exceeds uniforms[row] times the row's total: token i with probability probs[i], never a token of
    probability 0 (the sum does not rise there)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    targets = (upload(uniforms, probs.device, torch.float64) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
