"""Triton scoring and selection kernels for compression (docs/design-notes.md, "Compression"): window attention score,
max-pooling, global score merge, redundancy (raw and lightning) and the top-k keep set.
Scores are float32 [kv_heads, tokens]; signatures and semantics are those of kernels.reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipage.kernels.triton_attention import LOG2E, cache_args, codes_and_scales, dot_precision, next_pow2, softmax_fold

WINDOW_SPLIT = 512  # keys per program of the window-score statistics pass
ELEMENTWISE_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# Window attention score


@triton.jit
def _load_keys_1d_table(k_ptr, ks_ptr, table_ptr, kvh, t, t_ok, d, d_ok, table_width, scale_log2,
                        s_t, s_kb, s_ko, s_kh, s_kd, ss_b, ss_o, ss_h, q_dtype: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr):
    """Keys of logical positions t of one sequence (1-D block table) -> ([len(t), D_PAD], valid, the
    factor of their logits q @ k^T: scale_log2, times each key's scale ([1, len(t)]) in an 8-bit cache,
    whose codes come as q_dtype)."""
    col = t // BLOCK_SIZE
    blk = tl.load(table_ptr + col * s_t, mask=t_ok & (col < table_width), other=-1).to(tl.int64)
    ok = t_ok & (blk >= 0)
    blk = tl.maximum(blk, 0)
    off = t % BLOCK_SIZE
    k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + kvh * s_kh + d[None, :] * s_kd,
                mask=ok[:, None] & d_ok[None, :], other=0.0)
    logit_scale = scale_log2
    if QUANT:
        k, k_scales = codes_and_scales(k, ks_ptr, blk, off, kvh, ok, ss_b, ss_o, ss_h, q_dtype)
        logit_scale = (k_scales * scale_log2)[None, :]
    return k, ok, logit_scale


@triton.jit
def _window_stats_kernel(
    q_ptr, k_ptr, ks_ptr, table_ptr, m_ptr, l_ptr,
    kv_len, scale_log2, table_width, num_splits,
    s_qw, s_qh, s_qd, s_t, s_kb, s_ko, s_kh, s_kd, ss_b, ss_o, ss_h,
    W: tl.constexpr, W_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    R: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, QUANT: tl.constexpr,
):
    """Softmax row statistics (base-2 max and sum) of every (query head, window query) of one kv
    head over one split of the keys. Rows r = g * W_PAD + i."""
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    r = tl.arange(0, R)
    g = r // W_PAD
    i = r % W_PAD
    r_ok = (g < GROUP) & (i < W)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + i[:, None] * s_qw + (kvh * GROUP + g)[:, None] * s_qh + d[None, :] * s_qd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if not QUANT:  # (8-bit codes are converted to the query's dtype instead)
        q = q.to(k_ptr.dtype.element_ty)
    q_pos = kv_len - W + i
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    start = sp * SPLIT
    end = tl.minimum(start + SPLIT, kv_len)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        k, ok, logit_scale = _load_keys_1d_table(k_ptr, ks_ptr, table_ptr, kvh, t, t < end, d, d_ok,
                                                 table_width, scale_log2, s_t, s_kb, s_ko, s_kh, s_kd,
                                                 ss_b, ss_o, ss_h, q_ptr.dtype.element_ty, BLOCK_SIZE, QUANT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * logit_scale
        s = tl.where(ok[None, :] & (t[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_i, l_i, _, _ = softmax_fold(s, m_i, l_i)
    out = (kvh * num_splits + sp) * R + r
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit
def _window_scores_kernel(
    q_ptr, k_ptr, ks_ptr, table_ptr, m_ptr, l_ptr, out_ptr,
    kv_len, scale_log2, table_width, num_splits,
    s_qw, s_qh, s_qd, s_t, s_kb, s_ko, s_kh, s_kd, ss_b, ss_o, ss_h, s_oh, s_ot,
    W: tl.constexpr, W_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    R: tl.constexpr, NS_PAD: tl.constexpr, PREC: tl.constexpr, QUANT: tl.constexpr,
):
    """One (kv head, key tile): normalised probabilities of every window query of every head of the
    group, max over the group's heads, mean over the window."""
    kvh = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < kv_len
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    k, ok, logit_scale = _load_keys_1d_table(k_ptr, ks_ptr, table_ptr, kvh, t, t_ok, d, d_ok, table_width,
                                             scale_log2, s_t, s_kb, s_ko, s_kh, s_kd, ss_b, ss_o, ss_h,
                                             q_ptr.dtype.element_ty, BLOCK_SIZE, QUANT)
    i = tl.arange(0, W_PAD)
    i_ok = i < W
    q_pos = kv_len - W + i
    allowed = i_ok[:, None] & ok[None, :] & (t[None, :] <= q_pos[:, None])
    sp = tl.arange(0, NS_PAD)
    sp_ok = sp < num_splits
    best = tl.zeros([W_PAD, BLOCK_N], tl.float32)
    for g in tl.static_range(GROUP):
        q = tl.load(q_ptr + i[:, None] * s_qw + (kvh * GROUP + g) * s_qh + d[None, :] * s_qd,
                    mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(k.dtype)  # 8-bit codes: k is in q's dtype
        stat = (kvh * num_splits + sp)[:, None] * R + g * W_PAD + i[None, :]  # [NS_PAD, W_PAD]
        m_part = tl.load(m_ptr + stat, mask=sp_ok[:, None], other=float("-inf"))
        l_part = tl.load(l_ptr + stat, mask=sp_ok[:, None], other=0.0)
        m_row = tl.max(m_part, axis=0)
        m_row = tl.where(m_row == float("-inf"), 0.0, m_row)
        l_row = tl.sum(l_part * tl.exp2(m_part - m_row[None, :]), axis=0)
        l_row = tl.where(l_row > 0, l_row, 1.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * logit_scale
        p = tl.exp2(s - m_row[:, None]) / l_row[:, None]
        best = tl.maximum(best, tl.where(allowed, p, 0.0))
    score = tl.sum(best, axis=0) / W
    tl.store(out_ptr + kvh * s_oh + t * s_ot, score, mask=t_ok)


def window_attention_score(window_queries: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           kv_len: int, scale: float, k_scales: torch.Tensor | None = None) -> torch.Tensor:
    """How much the last w queries attend to each cached key: float32 [kv_heads, kv_len]."""
    w, q_heads, head_dim = window_queries.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    device = k_cache.device
    out = torch.empty((kv_heads, kv_len), dtype=torch.float32, device=device)
    if kv_len == 0:
        return out
    d_pad = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    w_pad = max(16, next_pow2(w))
    g_pad = next_pow2(group)
    block_n = 64 if d_pad <= 128 else 32
    num_splits = triton.cdiv(kv_len, WINDOW_SPLIT)
    rows = g_pad * w_pad
    m_buf = torch.empty((kv_heads, num_splits, rows), dtype=torch.float32, device=device)
    l_buf = torch.empty_like(m_buf)
    ks, ss_b, ss_o, ss_h, quant, prec = cache_args(window_queries, k_cache, k_scales)
    common = dict(W=w, W_PAD=w_pad, GROUP=group, G_PAD=g_pad, R=rows, HEAD_DIM=head_dim, D_PAD=d_pad,
                  BLOCK_SIZE=block_size, BLOCK_N=block_n, PREC=prec, QUANT=quant)
    table = block_table.reshape(-1)
    scale_log2 = float(scale) * LOG2E
    _window_stats_kernel[(kv_heads, num_splits)](
        window_queries, k_cache, ks, table, m_buf, l_buf,
        kv_len, scale_log2, table.numel(), num_splits,
        *window_queries.stride(), table.stride(0), *k_cache.stride(), ss_b, ss_o, ss_h,
        SPLIT=WINDOW_SPLIT, num_warps=8 if rows >= 128 else 4, **common,
    )
    _window_scores_kernel[(kv_heads, triton.cdiv(kv_len, block_n))](
        window_queries, k_cache, ks, table, m_buf, l_buf, out,
        kv_len, scale_log2, table.numel(), num_splits,
        *window_queries.stride(), table.stride(0), *k_cache.stride(), ss_b, ss_o, ss_h, *out.stride(),
        NS_PAD=max(2, next_pow2(num_splits)), num_warps=4, **common,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Pooling and global merge


@triton.jit
def _pool_kernel(x_ptr, out_ptr, T, s_xh, s_xt, s_oh, s_ot, KERNEL: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for j in tl.static_range(KERNEL):
        src = t + (j - KERNEL // 2)
        x = tl.load(x_ptr + h * s_xh + src * s_xt, mask=(src >= 0) & (src < T), other=float("-inf"))
        best = tl.maximum(best, x)
    tl.store(out_ptr + h * s_oh + t * s_ot, best, mask=t < T)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool along tokens (odd kernel, same length, -inf padding)."""
    heads, tokens = scores.shape
    out = torch.empty((heads, tokens), dtype=scores.dtype, device=scores.device)
    if tokens == 0 or heads == 0:
        return out
    _pool_kernel[(heads, triton.cdiv(tokens, ELEMENTWISE_BLOCK))](
        scores, out, tokens, *scores.stride(), *out.stride(), KERNEL=kernel, BLOCK=ELEMENTWISE_BLOCK)
    return out


@triton.jit
def _merge_kernel(cur_ptr, prev_ptr, out_ptr, T, num_previous, decay,
                  s_ch, s_ct, s_ph, s_pt, s_oh, s_ot, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t_ok = t < T
    cur = tl.load(cur_ptr + h * s_ch + t * s_ct, mask=t_ok)
    use_prev = t_ok & (t < num_previous)
    prev = tl.load(prev_ptr + h * s_ph + t * s_pt, mask=use_prev, other=0.0)
    merged = tl.where(use_prev, tl.maximum(cur, decay * prev), cur)
    tl.store(out_ptr + h * s_oh + t * s_ot, merged.to(out_ptr.dtype.element_ty), mask=t_ok)


def global_score_merge(current: torch.Tensor, previous: torch.Tensor, num_previous: int,
                       decay: float) -> torch.Tensor:
    """s = max(s_now, decay * s_prev) for the first `num_previous` tokens; later tokens keep s_now."""
    heads, tokens = current.shape
    out = torch.empty((heads, tokens), dtype=current.dtype, device=current.device)
    if tokens == 0 or heads == 0:
        return out
    _merge_kernel[(heads, triton.cdiv(tokens, ELEMENTWISE_BLOCK))](
        current, previous, out, tokens, int(num_previous), float(decay),
        *current.stride(), *previous.stride(), *out.stride(), BLOCK=ELEMENTWISE_BLOCK)
    return out


# ---------------------------------------------------------------------------------------------
# Redundancy


@triton.jit
def _unit_rows(keys_ptr, kvh, idx, T, s_kh, s_kt, s_kd, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """L2-normalised keys at token indices idx (zero vectors past T), fp32 [len(idx), D_PAD]."""
    d = tl.arange(0, D_PAD)
    x = tl.load(keys_ptr + kvh * s_kh + idx.to(tl.int64)[:, None] * s_kt + d[None, :] * s_kd,
                mask=(idx < T)[:, None] & (d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    return x / tl.maximum(norm, 1e-12)[:, None]


@triton.jit
def _segment_range(first, count, seg, padded, TILE: tl.constexpr):
    """Token range [lo, hi) of the segments that indices first .. first+count-1 fall in, with lo
    rounded down to a multiple of TILE."""
    last = tl.minimum(first + count, padded) - 1
    lo = (first // seg) * seg
    hi = tl.minimum(padded, (last // seg + 1) * seg)
    return (lo // TILE) * TILE, hi


@triton.jit
def _unit_keys_kernel(keys_ptr, unit_ptr, T, s_kh, s_kt, s_kd,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each key L2-normalised once, into unit [kv_heads, T, D_PAD] (zero columns past HEAD_DIM) in
    the keys' dtype: both passes below then read unit rows instead of normalising every tile again."""
    kvh = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_PAD)
    unit = _unit_rows(keys_ptr, kvh, idx, T, s_kh, s_kt, s_kd, HEAD_DIM, D_PAD)
    tl.store(unit_ptr + (kvh * T + idx.to(tl.int64))[:, None] * D_PAD + d[None, :],
             unit.to(unit_ptr.dtype.element_ty), mask=(idx < T)[:, None])


@triton.jit
def _unit_tile(unit_ptr, kvh, idx, T, D_PAD: tl.constexpr):
    """Unit keys at token indices idx (zero rows past T): [len(idx), D_PAD] in the unit keys' dtype."""
    d = tl.arange(0, D_PAD)
    return tl.load(unit_ptr + (kvh * T + idx.to(tl.int64))[:, None] * D_PAD + d[None, :],
                   mask=(idx < T)[:, None], other=0.0)


@triton.jit
def _own_keys(unit_ptr, T, padded, seg, D_PAD: tl.constexpr, OWN: tl.constexpr, OTHER: tl.constexpr):
    """This program's kv head, its OWN token indices with their unit keys, and the range of the
    other side to sweep (its segments, in tiles of OTHER)."""
    kvh = tl.program_id(0)
    first = tl.program_id(1) * OWN
    idx = first + tl.arange(0, OWN)
    unit = _unit_tile(unit_ptr, kvh, idx, T, D_PAD)
    lo, hi = _segment_range(first, OWN, seg, padded, OTHER)
    return kvh, idx, unit, lo, hi


@triton.jit
def _segment_sims(um, un, m, n, m_ok, n_ok, seg, PREC: tl.constexpr):
    """Cosine similarity of unit keys rows m x columns n (0 on the diagonal), and which pairs are
    valid and share a segment. Both passes must see the very same values."""
    sim = tl.dot(um, tl.trans(un), input_precision=PREC)
    sim = tl.where(m[:, None] == n[None, :], 0.0, sim)
    same = m_ok[:, None] & n_ok[None, :] & ((m // seg)[:, None] == (n // seg)[None, :])
    return sim, same


@triton.jit
def _latest_duplicate_kernel(
    unit_ptr, latest_ptr, T, padded, seg, threshold,
    D_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    """Pass 1: for each column n, the largest row m of its segment with sim(m, n) > threshold
    (diagonal counted as similarity 0), or -1."""
    kvh, n, un, lo, hi = _own_keys(unit_ptr, T, padded, seg, D_PAD, BN, BM)
    n_ok = n < padded
    latest = tl.full([BN], -1, tl.int32)
    for m0 in range(lo, hi, BM):
        m = m0 + tl.arange(0, BM)
        um = _unit_tile(unit_ptr, kvh, m, T, D_PAD)
        sim, same = _segment_sims(um, un, m, n, m < padded, n_ok, seg, PREC)
        near = same & (sim > threshold)
        latest = tl.maximum(latest, tl.max(tl.where(near, m[:, None], -1), axis=0))
    tl.store(latest_ptr + kvh * padded + n, latest, mask=n_ok)


@triton.jit
def _redundancy_sums_kernel(
    unit_ptr, latest_ptr, sums_ptr, T, padded, seg, threshold,
    D_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    """Pass 2: row sums of similarity within the row's segment, without (latest[n], n) pairs."""
    kvh, m, um, lo, hi = _own_keys(unit_ptr, T, padded, seg, D_PAD, BM, BN)
    m_ok = m < T
    acc = tl.zeros([BM], tl.float32)
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        n_ok = n < padded
        un = _unit_tile(unit_ptr, kvh, n, T, D_PAD)
        sim, same = _segment_sims(um, un, m, n, m_ok, n_ok, seg, PREC)
        sim = tl.where(same, sim, 0.0)
        latest = tl.load(latest_ptr + kvh * padded + n, mask=n_ok, other=-2)
        spared = same & (sim > threshold) & (m[:, None] == latest[None, :])
        acc += tl.sum(tl.where(spared, 0.0, sim), axis=1)
    tl.store(sums_ptr + kvh * T + m, acc, mask=m_ok)


def redundancy_sums(keys: torch.Tensor, lightning_block: int | None, threshold: float,
                    tile: int | None = None) -> torch.Tensor:
    """Row sums of cosine similarity with the R-KV rules (before the softmax): float32 [kv_heads, T]."""
    kv_heads, tokens, head_dim = keys.shape
    device = keys.device
    sums = torch.empty((kv_heads, tokens), dtype=torch.float32, device=device)
    if tokens == 0 or kv_heads == 0:
        return sums
    if lightning_block is None:
        seg = padded = tokens
    else:
        seg = int(lightning_block)
        padded = triton.cdiv(tokens, seg) * seg
    d_pad = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    tile = tile or (64 if d_pad <= 128 else 32)
    latest = torch.empty((kv_heads, padded), dtype=torch.int32, device=device)
    # In the keys' dtype: bf16 unit keys meet on bf16 tensor cores; fp32 ones keep IEEE products.
    unit = torch.empty((kv_heads, tokens, d_pad), dtype=keys.dtype, device=device)
    _unit_keys_kernel[(triton.cdiv(tokens, tile), kv_heads)](
        keys, unit, tokens, *keys.stride(), HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_T=tile, num_warps=4)
    args = dict(D_PAD=d_pad, BM=tile, BN=tile, PREC=dot_precision(keys.dtype), num_warps=4)
    _latest_duplicate_kernel[(kv_heads, triton.cdiv(padded, tile))](
        unit, latest, tokens, padded, seg, float(threshold), **args)
    _redundancy_sums_kernel[(kv_heads, triton.cdiv(tokens, tile))](
        unit, latest, sums, tokens, padded, seg, float(threshold), **args)
    return sums


def redundancy_score(keys: torch.Tensor, lightning_block: int | None, threshold: float,
                     temperature: float) -> torch.Tensor:
    """How much each key repeats the others (R-KV), softmaxed over tokens: float32 [kv_heads, T]."""
    tokens = keys.shape[1]
    sums = redundancy_sums(keys, lightning_block, threshold)
    return torch.softmax(sums / (tokens * temperature), dim=-1)


# ---------------------------------------------------------------------------------------------
# Top-k keep set


@triton.jit
def _order_key(x):
    """float32 -> int64 with the same order (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _count_at_least(s_ptr, row, T, s_st, mid, CHUNK: tl.constexpr):
    cnt = tl.zeros([1], tl.int64)
    for c0 in range(0, T, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        ok = t < T
        key = _order_key(tl.load(s_ptr + row + t * s_st, mask=ok, other=0.0))
        cnt += tl.sum((ok & (key >= mid)).to(tl.int64), axis=0)
    return cnt


@triton.jit
def _keep_kernel(s_ptr, out_ptr, T, keep, s_sh, s_st, s_oh, s_ok, CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """One row: bisection over the order-preserving integer keys for the keep-th largest value
    (32 steps), then every larger entry plus the lowest-index ties, written in ascending order."""
    h = tl.program_id(0)
    row = h.to(tl.int64) * s_sh
    c = tl.arange(0, CHUNK)
    if ONE_CHUNK:
        ok0 = c < T
        key0 = _order_key(tl.load(s_ptr + row + c * s_st, mask=ok0, other=0.0))
    lo = tl.full([1], -2147483648, tl.int64)
    hi = tl.full([1], 2147483647, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        if ONE_CHUNK:
            cnt = tl.sum((ok0 & (key0 >= mid)).to(tl.int64), axis=0)
        else:
            cnt = _count_at_least(s_ptr, row, T, s_st, mid, CHUNK)
        enough = cnt >= keep
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    thr = lo
    # Entries above the threshold all stay; ties at it fill the rest, lowest index first.
    if ONE_CHUNK:
        greater_total = tl.sum((ok0 & (key0 > thr)).to(tl.int64), axis=0)
    else:
        greater_total = _count_at_least(s_ptr, row, T, s_st, thr + 1, CHUNK)
    ties_wanted = keep - greater_total
    ties_seen = tl.zeros([1], tl.int64)
    written = tl.zeros([1], tl.int64)
    out_row = out_ptr + h.to(tl.int64) * s_oh
    for c0 in range(0, T, CHUNK):
        t = c0 + c
        ok = t < T
        if ONE_CHUNK:
            key = key0
        else:
            key = _order_key(tl.load(s_ptr + row + t * s_st, mask=ok, other=0.0))
        greater = ok & (key > thr)
        tie = ok & (key == thr)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0).to(tl.int64) + ties_seen  # inclusive
        chosen = greater | (tie & (tie_rank <= ties_wanted))
        pos = tl.cumsum(chosen.to(tl.int32), axis=0).to(tl.int64) - 1 + written
        tl.store(out_row + pos * s_ok, t.to(tl.int64), mask=chosen)
        ties_seen += tl.sum(tie.to(tl.int64), axis=0)
        written += tl.sum(chosen.to(tl.int64), axis=0)


KEEP_MAX_CHUNK = 8192


def keep_indices(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` best tokens of each head, ascending: int64 [kv_heads, keep]."""
    heads, tokens = scores.shape
    out = torch.empty((heads, keep), dtype=torch.int64, device=scores.device)
    if keep <= 0 or heads == 0:
        return out
    if keep > tokens:
        raise RuntimeError(f"keep_indices: keep ({keep}) is larger than the number of tokens ({tokens})")
    if scores.dtype != torch.float32:
        scores = scores.float()
    chunk = min(next_pow2(tokens), KEEP_MAX_CHUNK)
    _keep_kernel[(heads,)](scores, out, tokens, keep, *scores.stride(), *out.stride(),
                           CHUNK=chunk, ONE_CHUNK=tokens <= chunk, num_warps=8 if chunk >= 2048 else 4)
    return out
