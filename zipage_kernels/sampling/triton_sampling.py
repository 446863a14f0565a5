"""Triton version of `reference.sample_rows`: a sampled row's filters and its inverse-CDF draw in two
to four launches, whatever filters the rows ask for, where the PyTorch path launches some twenty
small kernels a step (docs/design-notes.md, "Sampling").

Each row's vocabulary is cut into chunks of CHUNK logits, one program each:
1. `_chunk_stats` (unless the rows ask for min-p without top-p): each chunk's largest scaled logit
   and the sum of exp(logit - that) over the tokens top-k keeps (all, without a top-k): top-p's
   normaliser, and the chunk's total where no top-p or min-p cuts further;
2. `_chunk_totals` (with top-p or min-p): every program settles its row's threshold from the chunk
   stats and the row's ranked candidates (the largest logit, the k-th, top-p's last kept
   candidate), then sums its chunk's kept weights exp(logit - max) in float64. Where a top-p row
   has no top-k, `_settle_top_p` settles top-p's cut first, one program a row, searching the whole
   row when its nucleus passes its candidates (a fourth launch);
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
SEARCH_BLOCK = 512  # logits read at a time while searching a row whose nucleus passes its candidates
SEARCH_WAYS = 16  # parts each pass of that search splits the range into: 8 passes over the row


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
def _row_scale(ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, row, vocab, chunks, temperature,
               HAS_RANKED: tl.constexpr, ASK_TOP_P: tl.constexpr, CHUNKS_BLOCK: tl.constexpr):
    """A row's largest scaled logit and top-p's normaliser (the sum of exp(logit - largest) over
    what top-k keeps of the row), from the chunk stats where the row asks for top-p."""
    if ASK_TOP_P or not HAS_RANKED:
        j = tl.arange(0, CHUNKS_BLOCK)
        at = stats_ptr + (row * chunks + j) * 2
        tops = tl.load(at, mask=j < chunks, other=float("-inf"))
        top = tl.max(tops, 0)
        zs = tl.load(at + 1, mask=j < chunks, other=0.0)
        normaliser = tl.sum(tl.where(j < chunks, zs * tl.exp(tops - top), 0.0), 0)
    else:
        top = tl.load(ranked_ptr + row * s_r) / temperature
        normaliser = 1.0
    return top, normaliser


@triton.jit
def _top_p_walk(ranked_ptr, s_r, n_ranked, row, temperature, top, normaliser, kth, top_p,
                RANKED_BLOCK: tl.constexpr):
    """How many ranked candidates top-p keeps: walked until the likelier ones reach top_p (at least one)."""
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
    return tl.maximum(kept, 1)  # the likeliest token always stays


@triton.jit
def _threshold(ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, cut_ptr, vocab, chunks,
               HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, ASK_TOP_P: tl.constexpr,
               SETTLED: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, RANKED_BLOCK: tl.constexpr):
    """(temperature, largest scaled logit, k-th, top-p's last kept logit, min_p) of a row. SETTLED:
    top-p's cut comes from `_settle_top_p`; otherwise every row's candidates settle it and each
    program walks them itself (no extra launch)."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(params_ptr + row * 5).to(tl.float32)
    min_p = tl.load(params_ptr + row * 5 + 3).to(tl.float32)
    kth = _kth(ranked_ptr, s_r, n_ranked, params_ptr, row, vocab, temperature, HAS_RANKED, ASK_TOP_K)
    top, normaliser = _row_scale(ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, row, vocab, chunks,
                                 temperature, HAS_RANKED, ASK_TOP_P, CHUNKS_BLOCK)
    last_kept = float("-inf")
    if ASK_TOP_P:
        if SETTLED:
            last_kept = tl.load(cut_ptr + row)
        else:
            top_p = tl.load(params_ptr + row * 5 + 2).to(tl.float32)
            kept = _top_p_walk(ranked_ptr, s_r, n_ranked, row, temperature, top, normaliser, kth, top_p, RANKED_BLOCK)
            last_kept = tl.where(top_p < 1.0, tl.load(ranked_ptr + row * s_r + kept - 1) / temperature, float("-inf"))
    return temperature, top, kth, last_kept, min_p


@triton.jit
def _order_key(x):
    """float32 -> int32 that orders as the floats do (negative floats' magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit(do_not_specialize=["s_r", "n_ranked"])  # one kernel whatever the top-k
def _settle_top_p(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, cut_ptr, vocab, chunks,
                  HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, CHUNKS_BLOCK: tl.constexpr,
                  RANKED_BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """One program a row: top-p's last kept logit (-inf where the row has no top-p). The row's
    ranked candidates are walked until the likelier ones reach top_p; a row that keeps every
    candidate with no top-k stopping among them (its nucleus reaches past them) is searched whole:
    the smallest logit v whose strictly larger logits hold less than top_p, in passes over the row
    that each split the range of v into WAYS parts (as ordered integers: exact in 32 / log2(WAYS)
    passes). Both give the rule the reference applies to a whole sort."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(params_ptr + row * 5).to(tl.float32)
    top_p = tl.load(params_ptr + row * 5 + 2).to(tl.float32)
    top_k = tl.load(params_ptr + row * 5 + 1).to(tl.int64)
    kth = _kth(ranked_ptr, s_r, n_ranked, params_ptr, row, vocab, temperature, HAS_RANKED, ASK_TOP_K)
    top, normaliser = _row_scale(ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, row, vocab, chunks,
                                 temperature, HAS_RANKED, True, CHUNKS_BLOCK)
    kept = _top_p_walk(ranked_ptr, s_r, n_ranked, row, temperature, top, normaliser, kth, top_p, RANKED_BLOCK)
    cut = tl.load(ranked_ptr + row * s_r + kept - 1) / temperature
    if (kept == n_ranked) & (n_ranked < vocab) & (top_k > n_ranked) & (top_p < 1.0):
        # keys: hi's strictly larger logits hold less than top_p, lo's do not (or lo is below all)
        hi = _order_key(cut).to(tl.int64)
        lo = tl.full([], -2 ** 31 - 1, tl.int64)  # below every int32 key
        goal = top_p * normaliser
        ways = tl.arange(0, WAYS)
        while hi - lo > 1:
            splits = lo + (hi - lo) * (ways.to(tl.int64) + 1) // (WAYS + 1)  # WAYS points in (lo, hi)
            splits = tl.minimum(tl.maximum(splits, lo + 1), hi - 1).to(tl.int32)
            above = tl.zeros([WAYS], tl.float32)
            for c0 in range(0, vocab, SEARCH_BLOCK):
                cols = c0 + tl.arange(0, SEARCH_BLOCK)
                s = tl.load(logits_ptr + row * s_l + cols, mask=cols < vocab, other=float("-inf")) / temperature
                w = tl.where(s >= kth, tl.exp(s - top), 0.0)
                above += tl.sum(tl.where(_order_key(s)[:, None] > splits[None, :], w[:, None], 0.0), 0)
            short = above < goal  # monotone: false for the low splits, true for the high ones
            hi = tl.minimum(hi, tl.min(tl.where(short, splits.to(tl.int64), hi), 0))
            lo = tl.maximum(lo, tl.max(tl.where(short, lo, splits.to(tl.int64)), 0))
        cut = _order_key(hi.to(tl.int32)).to(tl.float32, bitcast=True)
    tl.store(cut_ptr + row, tl.where(top_p < 1.0, cut, float("-inf")))


@triton.jit
def _weights(logits_ptr, s_l, row, cols, vocab, temperature, top, kth, last_kept, min_p):
    """exp(logit - largest) of the kept tokens among cols, 0 for the others, in float64."""
    s = tl.load(logits_ptr + row * s_l + cols, mask=cols < vocab, other=float("-inf")) / temperature
    w = tl.exp(s - top)
    keep = (s >= kth) & (s >= last_kept) & (w >= min_p) & (cols < vocab)
    return tl.where(keep, w, 0.0).to(tl.float64)


@triton.jit(do_not_specialize=["s_r", "n_ranked"])  # one kernel whatever the top-k
def _chunk_totals(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, cut_ptr, totals_ptr, vocab,
                  chunks, HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, ASK_TOP_P: tl.constexpr,
                  SETTLED: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, RANKED_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, top, kth, last_kept, min_p = _threshold(
        ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, cut_ptr, vocab, chunks,
        HAS_RANKED, ASK_TOP_K, ASK_TOP_P, SETTLED, CHUNKS_BLOCK, RANKED_BLOCK)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    w = _weights(logits_ptr, s_l, row, cols, vocab, temperature, top, kth, last_kept, min_p)
    tl.store(totals_ptr + row * chunks + chunk, tl.sum(w, 0))


@triton.jit(do_not_specialize=["s_r", "n_ranked"])  # one kernel whatever the top-k
def _pick(logits_ptr, s_l, ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, cut_ptr, totals_ptr, out_ptr, vocab,
          chunks, HAS_RANKED: tl.constexpr, ASK_TOP_K: tl.constexpr, ASK_TOP_P: tl.constexpr,
          SETTLED: tl.constexpr, FROM_STATS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_BLOCK: tl.constexpr,
          RANKED_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temperature, top, kth, last_kept, min_p = _threshold(
        ranked_ptr, s_r, n_ranked, params_ptr, stats_ptr, cut_ptr, vocab, chunks,
        HAS_RANKED, ASK_TOP_K, ASK_TOP_P, SETTLED, CHUNKS_BLOCK, RANKED_BLOCK)
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
    # Where every filtering row has a top-k its candidates settle top-p, and each program walks them;
    # otherwise one program a row settles it first, searching a row whose nucleus passes them.
    settled = ask_top_p and not asks[3]
    cut = torch.empty(rows, device=logits.device, dtype=torch.float32)  # unwritten unless settled
    if settled:
        _settle_top_p[(rows,)](*common, stats, cut, vocab, chunks, **flags, CHUNKS_BLOCK=blocks["CHUNKS_BLOCK"],
                               RANKED_BLOCK=RANKED_BLOCK, SEARCH_BLOCK=SEARCH_BLOCK, WAYS=SEARCH_WAYS, num_warps=8)
    if not from_stats:
        _chunk_totals[(rows, chunks)](*common, stats, cut, totals, vocab, chunks, **flags, ASK_TOP_P=ask_top_p,
                                      SETTLED=settled, **blocks, num_warps=4)
    _pick[(rows,)](*common, stats, cut, totals, out, vocab, chunks, **flags, ASK_TOP_P=ask_top_p,
                   SETTLED=settled, FROM_STATS=from_stats, **blocks, num_warps=4)
    return out
