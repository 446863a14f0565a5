"""Triton cache kernels: store K/V into slots, store queries into query-cache rows, the parallel
compaction of kept entries into target blocks (gather everything, then scatter: two launches), and
one sequence's entries gathered in logical order (dequantized in the same pass for an 8-bit cache).

An 8-bit cache (k_scales, v_scales given; see kernels.reference) is written as float8_e4m3fn or
int8 codes and a float32 scale per entry and KV head; compaction moves codes and scales, never
re-quantizing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipage.kernels import reference
from zipage.kernels.triton_attention import next_pow2

FP8_MAX = tl.constexpr(reference.FP8_MAX)  # the largest finite float8_e4m3fn
INT8_MAX = tl.constexpr(reference.INT8_MAX)
ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: float32 sums this large keep no fraction bits


@triton.jit
def code_scale(amax, INT8: tl.constexpr):
    """The scale of a row whose largest magnitude is amax (float32), as reference.quantize_rows:
    amax lands on the largest code (FP8_MAX, or INT8_MAX for an int8 cache); an all-zero row gets 1
    (its codes are 0 either way)."""
    if INT8:  # (IEEE division: `/` on the GPU may be off by an ulp, and an int8 code can flip with it)
        return tl.where(amax > 0, tl.math.div_rn(amax, INT8_MAX), 1.0)
    else:
        return tl.where(amax > 0, amax / FP8_MAX, 1.0)


@triton.jit
def quantize_codes(x, scale, INT8: tl.constexpr):
    """x (float32) divided by its row's scale and clamped to the largest code, as
    reference.quantize_rows. An fp8 store's cast then rounds to nearest even; an int8 one would
    truncate, so int8 codes are rounded here (ties to even: adding and taking away ROUNDER), after
    an IEEE division, as torch's."""
    if INT8:
        return (tl.clamp(tl.math.div_rn(x, scale), -INT8_MAX, INT8_MAX) + ROUNDER) - ROUNDER
    else:
        return tl.clamp(x / scale, -FP8_MAX, FP8_MAX)


def quantized_cache(k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> bool:
    """Whether the cache holds 8-bit codes (scales given); K and V are both or neither."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales go together")
    return k_scales is not None


def int8_codes(cache: torch.Tensor) -> bool:
    """Whether a cache's codes are int8 (else float8_e4m3fn, or no codes at all)."""
    return cache.dtype == torch.int8


@triton.jit
def _store_rows(src, dst, mask, scale_dst, row_mask, QUANT: tl.constexpr, INT8: tl.constexpr):
    """Load a tile of rows [H_PAD, D_PAD] through the pointers src and store it through dst; with
    QUANT each row is quantized on its own (int8 codes with INT8) and its scale stored through
    scale_dst [H_PAD]."""
    x = tl.load(src, mask=mask, other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        scale = code_scale(tl.max(tl.abs(x), axis=1), INT8)
        tl.store(scale_dst, scale, mask=row_mask)
        x = quantize_codes(x, scale[:, None], INT8)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_rows_kernel(
    a_ptr, b_ptr, dst_a_ptr, dst_b_ptr, slot_ptr, sc_a_ptr, sc_b_ptr,
    s_at, s_ah, s_ad, s_bt, s_bh, s_bd,
    s_xb, s_xo, s_xh, s_xd, s_yb, s_yo, s_yh, s_yd, s_sab, s_sao, s_sah, s_sbb, s_sbo, s_sbh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TWO: tl.constexpr, QUANT: tl.constexpr, INT8: tl.constexpr,
):
    """Row t of a (and of b when TWO) -> slot slot[t] of dst_a (dst_b); a negative slot is skipped.
    A slot addresses (slot // BLOCK_SIZE, slot % BLOCK_SIZE) in the destination's first two dims.
    With QUANT (an 8-bit cache; int8 codes with INT8) the rows' scales go to the same slot of sc_a (sc_b)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    row_mask = ok & (h < HEADS)
    mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    row = t.to(tl.int64)
    _store_rows(a_ptr + row * s_at + h[:, None] * s_ah + d[None, :] * s_ad,
                dst_a_ptr + blk * s_xb + off * s_xo + h[:, None] * s_xh + d[None, :] * s_xd, mask,
                sc_a_ptr + blk * s_sab + off * s_sao + h * s_sah, row_mask, QUANT, INT8)
    if TWO:
        _store_rows(b_ptr + row * s_bt + h[:, None] * s_bh + d[None, :] * s_bd,
                    dst_b_ptr + blk * s_yb + off * s_yo + h[:, None] * s_yh + d[None, :] * s_yd, mask,
                    sc_b_ptr + blk * s_sbb + off * s_sbo + h * s_sbh, row_mask, QUANT, INT8)


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Write key/value [tokens, kv_heads, head_dim] into their slots; a slot of -1 is skipped. With
    scales (an 8-bit cache) each entry is quantized on its own (reference.quantize_rows)."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    h_pad, d_pad = next_pow2(kv_heads), next_pow2(head_dim)
    quant = quantized_cache(k_scales, v_scales)
    scales = (k_scales, v_scales) if quant else (k_cache, v_cache)  # unused pointers without QUANT
    scale_strides = (*k_scales.stride(), *v_scales.stride()) if quant else (0,) * 6
    _store_rows_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping, *scales,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides,
        HEADS=kv_heads, HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad, BLOCK_SIZE=block_size, TWO=True,
        QUANT=quant, INT8=int8_codes(k_cache), num_warps=_warps(h_pad * d_pad),
    )


def store_queries(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """Copy queries [tokens, q_heads, head_dim] into query-cache rows [rows, q_heads, head_dim]; -1 skips."""
    tokens = query.shape[0]
    if tokens == 0:
        return
    q_heads, head_dim = query_cache.shape[1:]
    h_pad, d_pad = next_pow2(q_heads), next_pow2(head_dim)
    row_stride = query_cache.stride(0)
    _store_rows_kernel[(tokens,)](
        query, query, query_cache, query_cache, query_slot_mapping, query_cache, query_cache,
        *query.stride(), *query.stride(),
        row_stride, 0, *query_cache.stride()[1:], row_stride, 0, *query_cache.stride()[1:], *(0,) * 6,
        HEADS=q_heads, HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad, BLOCK_SIZE=1, TWO=False, QUANT=False, INT8=False,
        num_warps=_warps(h_pad * d_pad),
    )


# ---------------------------------------------------------------------------------------------
# Compaction


@triton.jit
def _compact_tile(slot_ptr, s_j, keep, h, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's entries j of the keep list for head h: their slots (stride s_j; -1 clamped to
    0, ok marks real ones), each slot's block and offset, the head dims d, the element mask and the
    offsets in the [keep, KV_HEADS, HEAD_DIM] buffer. Gather and scatter must agree on all of it."""
    j = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    j_ok = j < keep
    slot = tl.load(slot_ptr + j.to(tl.int64) * s_j, mask=j_ok, other=-1).to(tl.int64)
    ok = j_ok & (slot >= 0)
    slot = tl.maximum(slot, 0)
    d = tl.arange(0, D_PAD)
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    tmp = (j.to(tl.int64) * KV_HEADS + h)[:, None] * HEAD_DIM + d[None, :]
    return j, slot, ok, slot // BLOCK_SIZE, slot % BLOCK_SIZE, d, mask, tmp


@triton.jit
def _compact_gather_kernel(
    k_ptr, v_ptr, src_ptr, tmp_k_ptr, tmp_v_ptr, pos_ptr, tmp_pos_ptr, ks_ptr, vs_ptr, tmp_ks_ptr, tmp_vs_ptr,
    keep, s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd, s_sh, s_sj, s_pos_slot, s_pos_h,
    s_ksb, s_kso, s_ksh, s_vsb, s_vso, s_vsh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """Kept entries j of head h (their slots src[h, j]) -> tmp[j, h, :] (contiguous); with
    HAS_POSITIONS, each one's token position -> tmp_pos[j, h]; with HAS_SCALES (an 8-bit cache), its
    K and V scales -> tmp_ks[j, h], tmp_vs[j, h]."""
    h = tl.program_id(1)
    j, slot, ok, blk, off, d, mask, tmp = _compact_tile(src_ptr + h * s_sh, s_sj, keep, h,
                                                        KV_HEADS, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_K)
    k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + h * s_kh + d[None, :] * s_kd, mask=mask)
    tl.store(tmp_k_ptr + tmp, k, mask=mask)
    v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + h * s_vh + d[None, :] * s_vd, mask=mask)
    tl.store(tmp_v_ptr + tmp, v, mask=mask)
    if HAS_POSITIONS:
        pos = tl.load(pos_ptr + slot * s_pos_slot + h * s_pos_h, mask=ok)
        tl.store(tmp_pos_ptr + j.to(tl.int64) * KV_HEADS + h, pos, mask=ok)
    if HAS_SCALES:
        ks = tl.load(ks_ptr + blk * s_ksb + off * s_kso + h * s_ksh, mask=ok)
        tl.store(tmp_ks_ptr + j.to(tl.int64) * KV_HEADS + h, ks, mask=ok)
        vs = tl.load(vs_ptr + blk * s_vsb + off * s_vso + h * s_vsh, mask=ok)
        tl.store(tmp_vs_ptr + j.to(tl.int64) * KV_HEADS + h, vs, mask=ok)


@triton.jit
def _compact_scatter_kernel(
    k_ptr, v_ptr, dst_ptr, tmp_k_ptr, tmp_v_ptr, score_ptr, kept_ptr, pos_ptr, tmp_pos_ptr, choice_ptr,
    kept_choice_ptr, ks_ptr, vs_ptr, tmp_ks_ptr, tmp_vs_ptr, keep,
    s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd, s_dj, s_sc_slot, s_sc_h, s_kp_h, s_kp_j,
    s_pos_slot, s_pos_h, s_ch_slot, s_ch_h, s_kc_h, s_kc_j, s_ksb, s_kso, s_ksh, s_vsb, s_vso, s_vsh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_SCORES: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_CHOICES: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    """tmp[j, h, :] -> slot dst[j] of head h; the kept score of (h, j) into the score cache; with
    HAS_POSITIONS the gathered position, with HAS_CHOICES the score it was ranked by, with
    HAS_SCALES the gathered K and V scales, into theirs."""
    h = tl.program_id(1)
    j, dst, ok, blk, off, d, mask, tmp = _compact_tile(dst_ptr, s_dj, keep, h,
                                                       KV_HEADS, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_K)
    k = tl.load(tmp_k_ptr + tmp, mask=mask)
    tl.store(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + h * s_kh + d[None, :] * s_kd, k, mask=mask)
    v = tl.load(tmp_v_ptr + tmp, mask=mask)
    tl.store(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + h * s_vh + d[None, :] * s_vd, v, mask=mask)
    if HAS_SCORES:
        sc = tl.load(kept_ptr + h * s_kp_h + j.to(tl.int64) * s_kp_j, mask=ok)
        tl.store(score_ptr + dst * s_sc_slot + h * s_sc_h, sc.to(score_ptr.dtype.element_ty), mask=ok)
    if HAS_POSITIONS:
        pos = tl.load(tmp_pos_ptr + j.to(tl.int64) * KV_HEADS + h, mask=ok)
        tl.store(pos_ptr + dst * s_pos_slot + h * s_pos_h, pos, mask=ok)
    if HAS_CHOICES:
        ch = tl.load(kept_choice_ptr + h * s_kc_h + j.to(tl.int64) * s_kc_j, mask=ok)
        tl.store(choice_ptr + dst * s_ch_slot + h * s_ch_h, ch.to(choice_ptr.dtype.element_ty), mask=ok)
    if HAS_SCALES:
        ks = tl.load(tmp_ks_ptr + j.to(tl.int64) * KV_HEADS + h, mask=ok)
        tl.store(ks_ptr + blk * s_ksb + off * s_kso + h * s_ksh, ks, mask=ok)
        vs = tl.load(tmp_vs_ptr + j.to(tl.int64) * KV_HEADS + h, mask=ok)
        tl.store(vs_ptr + blk * s_vsb + off * s_vso + h * s_vsh, vs, mask=ok)


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
               src_slots: torch.Tensor, dst_slots: torch.Tensor, kept_scores: torch.Tensor | None,
               position_cache: torch.Tensor | None = None, choice_cache: torch.Tensor | None = None,
               kept_choices: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> None:
    """Move the kept entries of every KV head into the target slots (see kernels.reference), and
    their positions and ranking scores with them when those tables are given, and in an 8-bit cache
    their scales (codes and scales move as they are). Sources may overlap targets: the first launch
    gathers every kept entry into a buffer, the second (ordered after it on the stream) scatters them."""
    kv_heads, keep = src_slots.shape
    if keep == 0:
        return
    block_size, _, head_dim = k_cache.shape[1:]
    d_pad = next_pow2(head_dim)
    tmp_k = torch.empty((keep, kv_heads, head_dim), dtype=k_cache.dtype, device=k_cache.device)
    tmp_v = torch.empty((keep, kv_heads, head_dim), dtype=v_cache.dtype, device=v_cache.device)
    has_positions = position_cache is not None
    tmp_pos = (torch.empty((keep, kv_heads), dtype=position_cache.dtype, device=position_cache.device)
               if has_positions else tmp_k)
    pos_arg = position_cache if has_positions else tmp_k
    pos_strides = position_cache.stride() if has_positions else (0, 0)
    has_scales = quantized_cache(k_scales, v_scales)
    if has_scales:
        tmp_ks, tmp_vs = torch.empty((2, keep, kv_heads), dtype=k_scales.dtype, device=k_scales.device)
        scale_args = (k_scales, v_scales, tmp_ks, tmp_vs)
        scale_strides = (*k_scales.stride(), *v_scales.stride())
    else:
        scale_args, scale_strides = (tmp_k,) * 4, (0,) * 6
    block_k = 64 if d_pad <= 128 else 32
    grid = (triton.cdiv(keep, block_k), kv_heads)
    _compact_gather_kernel[grid](
        k_cache, v_cache, src_slots, tmp_k, tmp_v, pos_arg, tmp_pos, *scale_args, keep,
        *k_cache.stride(), *v_cache.stride(), *src_slots.stride(), *pos_strides, *scale_strides,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_K=block_k,
        HAS_POSITIONS=has_positions, HAS_SCALES=has_scales, num_warps=4,
    )
    has_scores = score_cache is not None and kept_scores is not None
    score_arg = score_cache if has_scores else tmp_k
    kept_arg = kept_scores if has_scores else tmp_k
    sc_strides = score_cache.stride() if has_scores else (0, 0)
    kp_strides = kept_scores.stride() if has_scores else (0, 0)
    has_choices = choice_cache is not None and kept_choices is not None
    choice_arg = choice_cache if has_choices else tmp_k
    kept_choice_arg = kept_choices if has_choices else tmp_k
    ch_strides = choice_cache.stride() if has_choices else (0, 0)
    kc_strides = kept_choices.stride() if has_choices else (0, 0)
    _compact_scatter_kernel[grid](
        k_cache, v_cache, dst_slots, tmp_k, tmp_v, score_arg, kept_arg, pos_arg, tmp_pos, choice_arg,
        kept_choice_arg, *scale_args, keep,
        *k_cache.stride(), *v_cache.stride(), dst_slots.stride(0), *sc_strides, *kp_strides, *pos_strides,
        *ch_strides, *kc_strides, *scale_strides,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_K=block_k,
        HAS_SCORES=has_scores, HAS_POSITIONS=has_positions, HAS_CHOICES=has_choices, HAS_SCALES=has_scales,
        num_warps=4,
    )


@triton.jit
def _gather_kv_kernel(cache_ptr, scales_ptr, table_ptr, out_ptr, length,
                      s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, s_ot, s_oh, s_od,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_T: tl.constexpr, HAS_SCALES: tl.constexpr):
    """Entries t of one KV head h: out[t, h, :] = cache[table[t // BLOCK_SIZE], t % BLOCK_SIZE, h, :],
    times the entry's scale with HAS_SCALES (in float32, as reference.dequantize), in out's dtype."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_PAD)
    ok = t < length
    blk = tl.load(table_ptr + t // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    off = t % BLOCK_SIZE
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(cache_ptr + blk[:, None] * s_cb + off[:, None] * s_co + h * s_ch + d[None, :] * s_cd, mask=mask)
    if HAS_SCALES:
        scale = tl.load(scales_ptr + blk * s_sb + off * s_so + h * s_sh, mask=ok, other=0.0)
        x = x.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * s_ot + h * s_oh + d[None, :] * s_od,
             x.to(out_ptr.dtype.element_ty), mask=mask)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's first `length` entries in logical order (see kernels.reference), in one launch:
    an 8-bit cache's codes come out dequantized and in `dtype` without float32 copies in between."""
    block_size, kv_heads, head_dim = cache.shape[1:]
    out_dtype = dtype or (torch.float32 if scales is not None else cache.dtype)
    out = torch.empty((length, kv_heads, head_dim), dtype=out_dtype, device=cache.device)
    if length == 0 or kv_heads == 0:
        return out
    has_scales = scales is not None
    scale_arg, scale_strides = (scales, scales.stride()) if has_scales else (cache, (0, 0, 0))
    block_t = 64
    _gather_kv_kernel[(triton.cdiv(length, block_t), kv_heads)](
        cache, scale_arg, block_table, out, length, *cache.stride(), *scale_strides, *out.stride(),
        HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size, BLOCK_T=block_t,
        HAS_SCALES=has_scales, num_warps=4,
    )
    return out
