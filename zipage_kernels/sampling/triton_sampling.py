"""Triton version of `reference.sample_rows`: a sampled row's filters and its inverse-CDF draw in two
or three launches, whatever filters the rows ask for, where the PyTorch path launches some twenty
small kernels a step (docs/design-notes.md, "Sampling").

Each row's vocabulary is cut into chunks of CHUNK logits, one program each:
1. `_chunk_stats` (unless the rows ask for min-p without top-p): each chunk's largest scaled logit
   and the sum of exp(logit - that) over the tokens top-k keeps (all, without a top-k): top-p's
   normaliser, and the chunk's total where no top-p or min-p cuts further;
2. `_chunk_totals` (with top-p or min-p): every program settles its row's threshold from the chunk
   stats and the row's ranked candidates (the largest logit, the k-th, top-p's last kept
   candidate), then sums its chunk's kept weights exp(logit - max) in float64;
3. `_pick`: one program a row finds the chunk where the running total passes u times the row's
   total and walks that chunk alone.
Weights are exp(logit - max) left unnormalised: the draw compares u times their sum, as the
reference compares u times its softmax's sum. Sums run in another order than the reference's, so
a draw that lands within rounding of a boundary (about 1e-7 of the row's mass) may take the token
beside the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipage.kernels.triton_attention import next_pow2

CHUNK = 2048  # logits a program reads: 75 programs a row for a 151,936 vocabulary
RANKED_BLOCK = 1024  # candidates read at a time while walking top-p


@triton.jit(do_not_specialize=["s_r", "n_ranked"])  # one kernel whatever the top-k
def _chunk_stats(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, vocab, chunks,
                 HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(params_ptr + row * 5).to(tl.float32)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    s = tl.load(logits_ptr + row * s_l + cols, mask=cols < vocab, other=float("-inf")) / temperature
    kth = _kth(ranked_ptr, s_r, n_ranked, params_ptr, row, vocab, temperature, HAS_RANKED, ASK_TOP_K)
    top = tl.max(s, 0)
    shift = tl.where(top > float("-inf"), top, 0.0)  # a chunk a grammar masks whole weighs nothing
    z = tl.sum(tl.where(s >= kth, tl.exp(s - shift), 0.0), 0)
    out = stats_ptr + (row * chunks + chunk) * 2
    tl.store(out, top)
    tl.store(out + 1, z)


@triton.jit
def _kth(ranked_ptr, s_r, n_ranked, params_ptr, row, vocab, temperature,
         HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr):
    """The row's k-th largest scaled logit, -inf when the row has no top-k."""
    kth = float("-inf")
    if HAS_RANKED and ASK_TOP_K:
        top_k = tl.load(params_ptr + row * 5 + 1).to(tl.int64)
        at = tl.minimum(top_k, n_ranked) - 1
        kth = tl.where(top_k < vocab, tl.load(ranked_ptr + row * s_r + at) / temperature, float("-inf"))
    return kth


@triton.jit
def _threshold(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, vocab, chunks,
               HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, ASK_TOP_P: tl.constexpr,
               CHUNKS_BLOCK: tl.constexpr, RANKED_BLOCK: tl.constexpr):
    """(temperature, largest scaled logit, k-th, top-p's last kept candidate, min_p) of a row."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(params_ptr + row * 5).to(tl.float32)
    top_p = tl.load(params_ptr + row * 5 + 2).to(tl.float32)
    min_p = tl.load(params_ptr + row * 5 + 3).to(tl.float32)
    kth = _kth(ranked_ptr, s_r, n_ranked, params_ptr, row, vocab, temperature, HAS_RANKED, ASK_TOP_K)
    if ASK_TOP_P or not HAS_RANKED:  # the chunk stats: the row's largest logit, top-p's normaliser
        j = tl.arange(0, CHUNKS_BLOCK)
        at = stats_ptr + (row * chunks + j) * 2
        tops = tl.load(at, mask=j < chunks, other=float("-inf"))
        top = tl.max(tops, 0)
        zs = tl.load(at + 1, mask=j < chunks, other=0.0)
        normaliser = tl.sum(tl.where(j < chunks, zs * tl.exp(tops - top), 0.0), 0)
    else:
        top = tl.load(ranked_ptr + row * s_r) / temperature
        normaliser = 1.0
    last_kept = float("-inf")
    if ASK_TOP_P:
        # walk the ranked candidates until the likelier ones reach top_p: those before stay
        kept = 0
        mass = 0.0
        start = 0
        while (start < n_ranked) & (mass < top_p):
            i = start + tl.arange(0, RANKED_BLOCK)
            v = tl.load(ranked_ptr + row * s_r + i, mask=i < n_ranked, other=float("-inf")) / temperature
            p = tl.where(v >= kth, tl.exp(v - top) / normaliser, 0.0)
            before = tl.cumsum(p, 0) - p + mass
            kept += tl.sum(((before < top_p) & (i < n_ranked)).to(tl.int32), 0)
            mass += tl.sum(p, 0)
            start += RANKED_BLOCK
        kept = tl.maximum(kept, 1)  # the likeliest token always stays
        last_kept = tl.where(top_p < 1.0, tl.load(ranked_ptr + row * s_r + kept - 1) / temperature, float("-inf"))
    return temperature, top, kth, last_kept, min_p


@triton.jit
def _weights(logits_ptr, s_l, row, cols, vocab, temperature, top, kth, last_kept, min_p):
    """exp(logit - largest) of the kept tokens among cols, 0 for the others, in float64."""
    s = tl.load(logits_ptr + row * s_l + cols, mask=cols < vocab, other=float("-inf")) / temperature
    w = tl.exp(s - top)
    keep = (s >= kth) & (s >= last_kept) & (w >= min_p) & (cols < vocab)
    return tl.where(keep, w, 0.0).to(tl.float64)


@triton.jit(do_not_specialize=["s_r", "n_ranked"])  # one kernel whatever the top-k
def _chunk_totals(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, totals_ptr, vocab, chunks,
                  HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, ASK_TOP_P: tl.constexpr,
                  CHUNK: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, RANKED_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, top, kth, last_kept, min_p = _threshold(
        logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, vocab, chunks,
        HAS_RANKED, ASK_TOP_K, ASK_TOP_P, CHUNKS_BLOCK, RANKED_BLOCK)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    w = _weights(logits_ptr, s_l, row, cols, vocab, temperature, top, kth, last_kept, min_p)
    tl.store(totals_ptr + row * chunks + chunk, tl.sum(w, 0))


@triton.jit(do_not_specialize=["s_r", "n_ranked"])  # one kernel whatever the top-k
def _pick(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, totals_ptr, out_ptr, vocab, chunks,
          HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, ASK_TOP_P: tl.constexpr, FROM_STATS: tl.constexpr,
          CHUNK: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, RANKED_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temperature, top, kth, last_kept, min_p = _threshold(
        logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, vocab, chunks,
        HAS_RANKED, ASK_TOP_K, ASK_TOP_P, CHUNKS_BLOCK, RANKED_BLOCK)
    u = tl.load(params_ptr + row * 5 + 4)
    j = tl.arange(0, CHUNKS_BLOCK)
    if FROM_STATS:  # top-k alone keeps what the chunk stats summed: each chunk's total rescaled
        at = stats_ptr + (row * chunks + j) * 2
        tops = tl.load(at, mask=j < chunks, other=float("-inf"))
        zs = tl.load(at + 1, mask=j < chunks, other=0.0)
        totals = tl.where(j < chunks, (zs * tl.exp(tops - top)).to(tl.float64), 0.0)
    else:
        totals = tl.load(totals_ptr + row * chunks + j, mask=j < chunks, other=0.0)
    ends = tl.cumsum(totals, 0)
    target = u * tl.sum(totals, 0)
    # the first chunk whose running total passes the target (rounding aside, the last with weight)
    chunk = tl.min(tl.where(ends > target, j, CHUNKS_BLOCK), 0)
    chunk = tl.where(chunk == CHUNKS_BLOCK, tl.max(tl.where(totals > 0, j, 0), 0), chunk)
    target -= tl.sum(tl.where(j < chunk, totals, 0.0), 0)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    w = _weights(logits_ptr, s_l, row, cols, vocab, temperature, top, kth, last_kept, min_p)
    ends = tl.cumsum(w, 0)
    pick = tl.min(tl.where(ends > target, cols, vocab), 0)
    pick = tl.where(pick == vocab, tl.max(tl.where(w > 0, cols, 0), 0), pick)
    tl.store(out_ptr + row, pick.to(tl.int64))


def sample_rows(logits: torch.Tensor, params: torch.Tensor, ranked: torch.Tensor | None,
                asks: tuple[bool, bool, bool, bool]) -> torch.Tensor:
    rows, vocab = logits.shape
    logits = logits.contiguous()
    params = params.contiguous()
    has_ranked = ranked is not None
    ranked = ranked.contiguous() if has_ranked else logits  # unread without candidates
    chunks = triton.cdiv(vocab, CHUNK)
    ask_top_k, ask_top_p = has_ranked and asks[0], has_ranked and asks[1]
    stats = torch.empty(rows, chunks, 2, device=logits.device, dtype=torch.float32)
    totals = torch.empty(rows, chunks, device=logits.device, dtype=torch.float64)  # unwritten from stats
    out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    common = (logits, logits.stride(0), ranked, ranked.stride(0), ranked.shape[-1], params)
    flags = dict(HAS_RANKED=has_ranked, ASK_TOP_K=ask_top_k)
    # without top-p or min-p a row keeps what the chunk stats sum (all, or top-k's), so the totals
    # come from them and the draw takes two launches
    from_stats = not ask_top_p and not (has_ranked and asks[2])
    if from_stats or ask_top_p or not has_ranked:
        _chunk_stats[(rows, chunks)](*common, stats, vocab, chunks, **flags, CHUNK=CHUNK, num_warps=4)
    blocks = dict(CHUNK=CHUNK, CHUNKS_BLOCK=max(16, next_pow2(chunks)), RANKED_BLOCK=RANKED_BLOCK)
    if not from_stats:
        _chunk_totals[(rows, chunks)](*common, stats, totals, vocab, chunks, **flags, ASK_TOP_P=ask_top_p,
                                      **blocks, num_warps=4)
    _pick[(rows,)](*common, stats, totals, out, vocab, chunks, **flags, ASK_TOP_P=ask_top_p, FROM_STATS=from_stats,
                   **blocks, num_warps=4)
    return out
