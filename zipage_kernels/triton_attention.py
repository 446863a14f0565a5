"""Triton attention kernels: paged decode attention (GQA, split-K) and variable-length causal
prefill attention reading keys/values through the block table.

Both have exactly the signatures and semantics of `kernels.reference`. Neither syncs with the host:
every grid and loop bound comes from tensor shapes or from values loaded inside the kernel, so
decode attention can be captured in a CUDA graph.

An 8-bit cache (k_scales, v_scales given) is read as codes converted to the query's dtype for tl.dot
(exact: every float8_e4m3fn value and every int8 is a bf16/fp16/fp32 value); the per-entry scales are folded in
rather than multiplied into every element: a key's scale multiplies its logit, a value's scale its
probability weight before P @ V. Those branches are constexpr (QUANT): for a cache in the model's
dtype the compiled kernels are the same as before, but for a few unused arguments.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from zipage.kernels import early_launch

try:  # bulk tensor copies (TMA) on Hopper; older Triton has no host-side descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

LOG2E = 1.4426950408889634
CODE_DTYPES = (torch.float8_e4m3fn, torch.int8)  # an 8-bit cache's codes (kernels.reference)

# Decode: below this many (sequence, kv head) programs per SM we split long contexts (split-K).
DECODE_PROGRAMS_PER_SM = 2
# Tokens: no partition is shorter (a multiple of the key tile). One key tile: a short context then
# spreads over many programs of one tile each, which one stream waits on least (64 against 256:
# a Qwen3-0.6B stream 11% faster; docs/benchmarks.md, "Shorter decode partitions").
DECODE_MIN_PARTITION = 64
# Keys per step of the decode loop, for every block size: with smaller blocks a tile spans several
# blocks (block ids gathered per token), with larger ones it stays inside one block.
DECODE_TILE = 64
REDUCE_CHUNK = 16  # partitions combined per step of the reduce kernel


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def _tile_blocks(table_row, s_tn, table_width, t0, t, t_ok, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache block of each position t of a key tile starting at t0 (one table entry when the tile
    lies inside one block), and t_ok narrowed to positions whose block exists (-1 padding)."""
    if BLOCK_N <= BLOCK_SIZE:
        col = t0 // BLOCK_SIZE
        blk = tl.load(table_row + col * s_tn, mask=col < table_width, other=-1)
    else:
        col = t // BLOCK_SIZE
        blk = tl.load(table_row + col * s_tn, mask=t_ok & (col < table_width), other=-1)
    return tl.maximum(blk, 0).to(tl.int64), t_ok & (blk >= 0)


# Four 8-bit codes ($2, lowest byte first) to four fp16 in two registers ($0: the first two, low
# half first; $1: the last two); both exact. e4m3: the hardware's pair conversion. int8: each code
# offset by 128 becomes the low mantissa byte of 1024 in fp16 (0x64XX is 1024 + XX), then 1152 is
# taken off two at a time (tests/test_code_conversions.py runs both on every byte).
E4M3_TO_F16_PTX = tl.constexpr(
    "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi;}")
INT8_TO_F16_PTX = tl.constexpr(
    "{.reg .b32 y, m; xor.b32 y, $2, 0x80808080; mov.b32 m, 0x64806480;"
    " prmt.b32 $0, y, 0x64646464, 0x4140; prmt.b32 $1, y, 0x64646464, 0x4342;"
    " sub.rn.f16x2 $0, $0, m; sub.rn.f16x2 $1, $1, m;}")


@triton.jit
def e4m3_to_f16(codes, PURE: tl.constexpr):
    return tl.inline_asm_elementwise(E4M3_TO_F16_PTX, "=r,=r,r", [codes.to(tl.uint8, bitcast=True)],
                                     dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def int8_to_f16(codes, PURE: tl.constexpr):
    return tl.inline_asm_elementwise(INT8_TO_F16_PTX, "=r,=r,r", [codes], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def codes_as(codes, dtype: tl.constexpr, IN_PTX: tl.constexpr = False, WHERE_LOADED: tl.constexpr = False):
    """A tile of 8-bit codes [rows, D] as dtype for tl.dot. IN_PTX (fp16 products, compiled for a
    GPU: the interpreter runs no PTX) converts them with the PTX blocks above, which are cheaper than
    the compiler's casts. The compiler moves a pure conversion past the shuffle into the product's
    operand layout; WHERE_LOADED makes it opaque, so the conversion runs in the layout the tile was
    loaded in and the shuffle moves 16-bit values, which ldmatrix transposes. A value tile needs
    that: its operand pairs run along the keys, which lie in different rows, and 8-bit codes are
    otherwise gathered from shared memory a byte at a time (docs/design-notes.md, "KV in 8 bits")."""
    if IN_PTX:
        if codes.dtype == tl.int8:
            return int8_to_f16(codes, not WHERE_LOADED)
        else:
            return e4m3_to_f16(codes, not WHERE_LOADED)
    else:
        return codes.to(dtype)


@triton.jit
def codes_and_scales(codes, scales_ptr, blk, off, kvh, row_ok, ss_b, ss_o, ss_h, dtype: tl.constexpr,
                     IN_PTX: tl.constexpr = False, WHERE_LOADED: tl.constexpr = False):
    """A tile of 8-bit codes [rows, D] of kv head kvh at (cache block blk, offset off) per row, as
    dtype (codes_as), and each row's scale [rows] (0 where not row_ok): value = code * scale."""
    scales = tl.load(scales_ptr + blk * ss_b + off * ss_o + kvh * ss_h, mask=row_ok, other=0.0)
    return codes_as(codes, dtype, IN_PTX, WHERE_LOADED), scales


# fp16 products weigh probabilities by value scales times this (a power of two: exact), undone on the
# output. A scale is a row's largest magnitude / 448, so weights of p * scale alone would fall below
# fp16's normal range (6.1e-5) for rows under 0.03 and lose bits; times 1024 they stay normal down to
# rows of 2.7e-5, and finite up to 28,658 (far past any value a bf16 model stores).
FP16_VALUE_WEIGHT = tl.constexpr(1024.0)


@triton.jit
def weigh_by_value_scales(p, v_scales, F16: tl.constexpr):
    """Probabilities p [rows, keys] weighed by each key's value scale, ready for P @ V (times
    FP16_VALUE_WEIGHT for fp16 products)."""
    if F16:
        v_scales = v_scales * FP16_VALUE_WEIGHT
    return p * v_scales[None, :]


@triton.jit
def softmax_fold(s, m_i, l_i):
    """Online softmax in base 2: the running row max and sum after one more tile of scores s
    [rows, keys] (-inf where masked), plus the tile's probabilities against the new max and the
    factor that rescales what was summed before."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid -inf - -inf = nan
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def softmax_fold_all_seen(s, m_i, l_i, scale):
    """softmax_fold for a tile in which every row sees at least one key, of scores s times `scale`:
    no -inf guard, and the scale rides in the exponent's multiply-add."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale)
    p = tl.exp2(s * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, table_row, s_tn, table_width, t0, t, t_ok, q_pos, kvh,
    d, d_ok, scale_log2, s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd, ss_b, ss_o, ss_h,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, F16: tl.constexpr = False, PTX: tl.constexpr = False,
):
    """Fold the key tile at positions t (valid where t_ok) of one kv head, read through the block
    table, into the running (max, sum, accumulator) of the query rows q. CAUSAL also hides keys
    past each row's position q_pos; without it only missing keys are hidden. QUANT: the caches hold
    codes, their scales at ks_ptr, vs_ptr (strides ss_*); F16: q is fp16 and so are the products;
    PTX: the codes convert through codes_as's PTX, the values where they were loaded."""
    blk, t_ok = _tile_blocks(table_row, s_tn, table_width, t0, t, t_ok, BLOCK_N, BLOCK_SIZE)
    off = t % BLOCK_SIZE
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + (blk * s_kb + off * s_ko)[:, None] + kvh * s_kh + d[None, :] * s_kd,
                mask=kv_mask, other=0.0)
    logit_scale = scale_log2
    if QUANT:  # one factor per key: its scale with the softmax scale
        k, k_scales = codes_and_scales(k, ks_ptr, blk, off, kvh, t_ok, ss_b, ss_o, ss_h, q.dtype, PTX)
        logit_scale = (k_scales * scale_log2)[None, :]
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * logit_scale
    if CAUSAL:
        s = tl.where(t_ok[None, :] & (t[None, :] <= q_pos[:, None]), s, float("-inf"))
    else:
        s = tl.where(t_ok[None, :], s, float("-inf"))
    m_i, l_i, p, alpha = softmax_fold(s, m_i, l_i)
    v = tl.load(v_ptr + (blk * s_vb + off * s_vo)[:, None] + kvh * s_vh + d[None, :] * s_vd,
                mask=kv_mask, other=0.0)
    if QUANT:  # a value's scale weighs its probability
        v, v_scales = codes_and_scales(v, vs_ptr, blk, off, kvh, t_ok, ss_b, ss_o, ss_h, q.dtype, PTX, True)
        p = weigh_by_value_scales(p, v_scales, F16)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_i, l_i, acc


@triton.jit
def _attend_whole_tile(q, m_i, l_i, acc, blk, off0, k_ptr, v_ptr, k_desc, v_desc, ks_ptr, vs_ptr,
                       rel_k, rel_v, rel_s, s_kb, s_ko, s_vb, s_vo, ss_b, ss_o, kvh, d_ok, scale_log2,
                       BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, FULL_D: tl.constexpr,
                       PREC: tl.constexpr, QUANT: tl.constexpr, F16: tl.constexpr, PTX: tl.constexpr,
                       TMA: tl.constexpr):
    """_attend_tile for a tile whose keys are all valid, at offset off0 of cache block blk: no masks
    but a head width short of its power of two (FULL_D false), and every query row sees a key, so
    the softmax needs no -inf guard. Keys and values come through pointers (each thread's part of
    the tile: rel_k, rel_v), or with TMA by bulk copy from descriptors of the caches' row views
    [blocks * BLOCK_SIZE, kv heads * HEAD_DIM]; scales through pointers (rel_s)."""
    row0 = (blk * BLOCK_SIZE + off0).to(tl.int32)
    if TMA:
        k = k_desc.load([row0, kvh * HEAD_DIM])
    elif FULL_D:
        k = tl.load(k_ptr + blk * s_kb + off0 * s_ko + rel_k)
    else:
        k = tl.load(k_ptr + blk * s_kb + off0 * s_ko + rel_k, mask=d_ok[None, :], other=0.0)
    logit_scale = scale_log2
    if QUANT:
        logit_scale = (tl.load(ks_ptr + blk * ss_b + off0 * ss_o + rel_s) * scale_log2)[None, :]
        k = codes_as(k, q.dtype, PTX)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * logit_scale
    m_i, l_i, p, alpha = softmax_fold_all_seen(s, m_i, l_i, 1.0)
    if TMA:
        v = v_desc.load([row0, kvh * HEAD_DIM])
    elif FULL_D:
        v = tl.load(v_ptr + blk * s_vb + off0 * s_vo + rel_v)
    else:
        v = tl.load(v_ptr + blk * s_vb + off0 * s_vo + rel_v, mask=d_ok[None, :], other=0.0)
    if QUANT:
        p = weigh_by_value_scales(p, tl.load(vs_ptr + blk * ss_b + off0 * ss_o + rel_s), F16)
        v = codes_as(v, q.dtype, PTX, True)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_i, l_i, acc


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (a small fixed number off CUDA, e.g. the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE fp32 products (no TF32 rounding), so an fp32 engine matches the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cache_args(query: torch.Tensor, cache: torch.Tensor, *scales: torch.Tensor | None) -> tuple:
    """Kernel arguments for reading a cache: its scales tensors (the cache itself, never read, when
    there are none), their strides (one layout for all), QUANT and the dot precision. tl.dot runs in
    the cache's dtype, or, for an 8-bit cache, in the query's (the codes are converted to it)."""
    quant = scales[0] is not None
    if quant != (cache.dtype in CODE_DTYPES) or any((s is not None) != quant for s in scales):
        raise ValueError(f"a {cache.dtype} cache needs scales exactly when it holds 8-bit codes")
    if not quant:
        return (cache,) * len(scales) + (0, 0, 0, False, dot_precision(cache.dtype))
    if any(s.stride() != scales[0].stride() for s in scales):
        raise ValueError("k_scales and v_scales must share one layout")
    return (*scales, *scales[0].stride(), True, dot_precision(query.dtype))


# ---------------------------------------------------------------------------------------------
# Paged decode attention


@triton.jit
def _partition_len(ctx, num_partitions, min_partition, BLOCK_N: tl.constexpr):
    """Tokens per partition of a context of ctx entries split num_partitions ways."""
    share = (ctx + num_partitions - 1) // num_partitions
    share = (share + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return tl.maximum(tl.maximum(share, min_partition), BLOCK_N)


# Lengths and table widths change from batch to batch; Triton would otherwise compile a new binary
# whenever one of them turns divisible by 16 or not, pausing every stream mid-serve.
@triton.jit(do_not_specialize=["table_width", "num_partitions", "min_partition", "s_tb"])
def _decode_partition_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, ks_ptr, vs_ptr, table_ptr, lens_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    scale_log2, table_width, num_partitions, min_partition,
    s_qb, s_qh, s_qd,
    s_kb, s_ko, s_kh, s_kd,
    s_vb, s_vo, s_vh, s_vd,
    ss_b, ss_o, ss_h,
    s_tb, s_tn,
    s_ob, s_oh, s_od,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, WHOLE_TILES: tl.constexpr = True, F16: tl.constexpr = False, PDL: tl.constexpr = False,
    PTX: tl.constexpr = False, TMA: tl.constexpr = False, TABLE_AHEAD: tl.constexpr = 0,
):
    """One (sequence, kv head, partition of the context): all GROUP query heads against every key
    of the partition, online softmax in base 2. SINGLE writes the normalised output directly;
    otherwise the partition's running max, sum and unnormalised accumulator go to the reduce.

    The number of partitions comes from shapes; their length from this sequence's own context
    (an even share, rounded up to the key tile, at least min_partition), so a short context in a
    wide table uses few partitions and a long one all of them; unused partitions write nothing
    the reduce reads."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    early_launch.wait_then_release(PDL)  # for the query and the newest key (and any input a caller just wrote)
    ctx = tl.load(lens_ptr + b)
    partition = _partition_len(ctx, num_partitions, min_partition, BLOCK_N)
    start = part * partition
    end = tl.minimum(start + partition, ctx)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if not QUANT:  # (8-bit codes are converted to the query's dtype instead)
        q = q.to(k_ptr.dtype.element_ty)
    if F16:  # e4m3 codes take fp16 products (see DecodeLaunch)
        q = q.to(tl.float16)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * s_tb
    n = tl.arange(0, BLOCK_N)
    tail = start
    if WHOLE_TILES and BLOCK_N <= BLOCK_SIZE:
        # Whole tiles first: every key valid and in one block, so one table entry and one base
        # address a tile, no masks (docs/design-notes.md, "KV in 8 bits").
        tail = start + (end - start) // BLOCK_N * BLOCK_N
        rel_k = n[:, None] * s_ko + kvh * s_kh + d[None, :] * s_kd
        rel_v = n[:, None] * s_vo + kvh * s_vh + d[None, :] * s_vd
        rel_s = n * ss_o + kvh * ss_h
        if TABLE_AHEAD > 0:
            # The table entries of TABLE_AHEAD blocks at a time held in registers: no tile's copy
            # then waits on a load of its table entry (docs/design-notes.md, "KV in 8 bits").
            c = tl.arange(0, TABLE_AHEAD)
            for col0 in range(start // BLOCK_SIZE, (tail + BLOCK_SIZE - 1) // BLOCK_SIZE, TABLE_AHEAD):
                blks = tl.load(table_row + (col0 + c) * s_tn, mask=col0 + c < table_width, other=0)
                for t0 in range(tl.maximum(start, col0 * BLOCK_SIZE),
                                tl.minimum(tail, (col0 + TABLE_AHEAD) * BLOCK_SIZE), BLOCK_N):
                    blk = tl.sum(tl.where(c == t0 // BLOCK_SIZE - col0, blks, 0), axis=0).to(tl.int64)
                    m_i, l_i, acc = _attend_whole_tile(
                        q, m_i, l_i, acc, blk, tl.multiple_of(t0 % BLOCK_SIZE, BLOCK_N), k_ptr, v_ptr, k_desc,
                        v_desc, ks_ptr, vs_ptr, rel_k, rel_v, rel_s, s_kb, s_ko, s_vb, s_vo, ss_b, ss_o, kvh,
                        d_ok, scale_log2, BLOCK_SIZE, HEAD_DIM, HEAD_DIM == D_PAD, PREC, QUANT, F16, PTX, TMA)
        else:
            for t0 in range(start, tail, BLOCK_N):
                blk = tl.load(table_row + (t0 // BLOCK_SIZE) * s_tn).to(tl.int64)
                m_i, l_i, acc = _attend_whole_tile(
                    q, m_i, l_i, acc, blk, tl.multiple_of(t0 % BLOCK_SIZE, BLOCK_N), k_ptr, v_ptr, k_desc,
                    v_desc, ks_ptr, vs_ptr, rel_k, rel_v, rel_s, s_kb, s_ko, s_vb, s_vo, ss_b, ss_o, kvh,
                    d_ok, scale_log2, BLOCK_SIZE, HEAD_DIM, HEAD_DIM == D_PAD, PREC, QUANT, F16, PTX, TMA)
    for t0 in range(tail, end, BLOCK_N):
        t = t0 + n
        # Every key of the context precedes the one query, so nothing is causally hidden.
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, table_row, s_tn,
                                     table_width, t0, t, t < end, ctx - 1, kvh, d, d_ok, scale_log2,
                                     s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd, ss_b, ss_o, ss_h,
                                     BLOCK_N, BLOCK_SIZE, False, PREC, QUANT, F16, PTX)
    if F16:
        acc = acc * (1.0 / FP16_VALUE_WEIGHT)

    if SINGLE:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + d[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        row = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_partitions + part  # [G_PAD]
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_partitions", "min_partition"])
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, lens_ptr, out_ptr, num_partitions, min_partition,
    s_ob, s_oh, s_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Combine the partitions of one (sequence, query head); partitions past the context are skipped."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    early_launch.wait_then_release(PDL)
    ctx = tl.load(lens_ptr + b)
    partition = _partition_len(ctx, num_partitions, min_partition, BLOCK_N)
    used = tl.minimum((ctx + partition - 1) // partition, num_partitions)
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_partitions
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    c = tl.arange(0, CHUNK)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for p0 in range(0, used, CHUNK):
        p = p0 + c
        p_ok = p < used
        m = tl.load(m_ptr + base + p, mask=p_ok, other=float("-inf"))
        l = tl.load(l_ptr + base + p, mask=p_ok, other=0.0)
        a = tl.load(acc_ptr + (base + p)[:, None] * HEAD_DIM + d[None, :],
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe)  # [CHUNK]
        l_run = l_run * alpha + tl.sum(l * w, axis=0)
        acc = acc * alpha + tl.sum(a * w[:, None], axis=0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class DecodeLaunch:
    """How the decode kernel runs over one kind of cache: warps a program, keys a step of its loop,
    a cap on registers a thread (None: the compiler's choice), whether whole tiles take the unmasked
    loop, whether 8-bit codes meet 16-bit queries in fp16 products, and whether those codes convert
    through PTX, values where they were loaded (codes_as; fp16 products only), whether whole tiles
    come by bulk copy (TMA, Hopper) instead of each thread's loads, the copy pipeline's stages, and
    how many table entries the whole-tile loop reads into registers at a time (0: one a tile)."""
    warps: int
    tile: int = DECODE_TILE
    max_registers: int | None = None
    whole_tiles: bool = True
    fp16_products: bool = False
    ptx_codes: bool = False
    tma: bool = False
    stages: int = 2
    table_ahead: int = 0

    def __post_init__(self):
        powers = {"warps": self.warps, "tile": self.tile}
        if self.table_ahead:  # (a register tensor's length)
            powers["table_ahead"] = self.table_ahead
        bad = [f"{name}={value}" for name, value in powers.items() if value < 1 or value & (value - 1)]
        if self.stages < 1 or self.table_ahead < 0 or (self.max_registers is not None and self.max_registers < 1):
            bad.append(f"stages={self.stages}, table_ahead={self.table_ahead}, max_registers={self.max_registers}")
        if bad:
            raise ValueError(f"decode launch: warps and tile must be powers of two, table_ahead 0 or one, "
                             f"stages and max_registers positive: {'; '.join(bad)}")

    def with_ptx_codes(self) -> "DecodeLaunch":
        """This launch with its codes through PTX (and so fp16 products), as the benchmarks time it."""
        return replace(self, fp16_products=True, ptx_codes=True)


# Per cache: chosen on an H100 over Qwen3-0.6B and -8B attention shapes (docs/benchmarks.md,
# "Decode attention over 8-bit codes: whole tiles and fp16 products"). A cache in the model's dtype
# keeps the masked loop (whole tiles: 9% faster at 88 sequences, even at 45-47, 3% slower at 256).
# An int8 tile does twice bf16's products and conversions per byte read, so its programs are 2
# warps, capped to keep six on an SM. e4m3 codes convert to fp16 in one instruction a pair, to bf16
# in four (two of them F2F, at a quarter of the FP32 rate), so an fp8 cache meets fp16 queries.
# Codes through PTX (ptx_codes) cut each 8-bit loop's instructions but bought fp8 nothing and cost
# int8 resident programs at the memory-pressure batch: off (docs/design-notes.md, "KV in 8 bits").
DECODE_LAUNCH = {"model": DecodeLaunch(4, whole_tiles=False),
                 torch.int8: DecodeLaunch(2, max_registers=168),
                 torch.float8_e4m3fn: DecodeLaunch(4, fp16_products=True)}


def decode_launch(cache_dtype: torch.dtype) -> DecodeLaunch:
    """The decode launch for a cache of this dtype (8-bit codes, or the model's dtype)."""
    return DECODE_LAUNCH.get(cache_dtype, DECODE_LAUNCH["model"])


def decode_num_partitions(batch: int, kv_heads: int, table_width: int, block_size: int,
                          device: torch.device) -> int:
    """Split-K ways, from shapes only (graph safe): 1 when the (sequence, kv head) programs already
    fill the GPU (about DECODE_PROGRAMS_PER_SM per SM), otherwise enough partitions to fill it,
    never more than the table could hold at DECODE_MIN_PARTITION tokens each."""
    programs = batch * kv_heads
    target = DECODE_PROGRAMS_PER_SM * num_sms(device)
    if programs >= target:
        return 1
    most = max(1, triton.cdiv(table_width * block_size, DECODE_MIN_PARTITION))
    return max(1, min(triton.cdiv(target, programs), most))


def paged_decode_attention_impl(query, k_cache, v_cache, block_tables, context_lens, scale,
                                num_partitions: int | None = None, min_partition: int | None = None,
                                block_n: int | None = None, k_scales=None, v_scales=None,
                                num_warps: int | None = None, num_stages: int | None = None,
                                max_registers: int | None = None, launch: DecodeLaunch | None = None):
    """paged_decode_attention with the split-K knobs open for tests: ways (None: from the shapes),
    shortest partition in tokens (a multiple of the key tile), the key tile, warps, stages, a cap
    on registers per thread, and the launch settings those default to (None: the cache's)."""
    batch, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty((batch, q_heads, head_dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    table_width = block_tables.shape[1]
    launch = launch or decode_launch(k_cache.dtype)
    tile = block_n or launch.tile
    num_warps = num_warps or launch.warps
    num_stages = num_stages or launch.stages
    max_registers = max_registers or launch.max_registers
    if num_partitions is None:
        num_partitions = decode_num_partitions(batch, kv_heads, table_width, block_size, query.device)
    if min_partition is None:
        min_partition = max(DECODE_MIN_PARTITION, tile)
    assert min_partition % tile == 0, "partitions must be whole key tiles"
    single = num_partitions == 1
    if single:
        m_buf = l_buf = acc_buf = out  # unused
    else:
        m_buf = torch.empty((batch, q_heads, num_partitions), dtype=torch.float32, device=query.device)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty((batch, q_heads, num_partitions, head_dim), dtype=torch.float32, device=query.device)
    d_pad = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    g_pad = max(16, next_pow2(group))
    ks, vs, ss_b, ss_o, ss_h, quant, prec = cache_args(query, k_cache, k_scales, v_scales)
    f16 = quant and launch.fp16_products and query.dtype != torch.float32
    grid = (batch, kv_heads, num_partitions)
    early = early_launch.launch_args(query.device)
    tma = (launch.tma and launch.whole_tiles and tile <= block_size
           and _tma_ok(k_cache, head_dim, d_pad) and _tma_ok(v_cache, head_dim, d_pad))
    if tma:
        k_desc = _row_view_descriptor(k_cache, tile, head_dim)
        v_desc = _row_view_descriptor(v_cache, tile, head_dim)
    else:
        k_desc, v_desc = k_cache, v_cache  # unused
    _decode_partition_kernel[grid](
        query, k_cache, v_cache, k_desc, v_desc, ks, vs, block_tables, context_lens,
        out, m_buf, l_buf, acc_buf,
        float(scale) * LOG2E, table_width, num_partitions, min_partition,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), ss_b, ss_o, ss_h,
        *block_tables.stride(), *out.stride(),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=tile, SINGLE=single, PREC=prec, QUANT=quant,
        WHOLE_TILES=launch.whole_tiles, F16=f16, PTX=f16 and launch.ptx_codes and query.is_cuda, TMA=tma,
        TABLE_AHEAD=launch.table_ahead,
        num_warps=num_warps, num_stages=num_stages, **early,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    if not single:
        _decode_reduce_kernel[(batch, q_heads)](
            m_buf, l_buf, acc_buf, context_lens, out, num_partitions, min_partition, *out.stride(),
            HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=tile, CHUNK=REDUCE_CHUNK,
            num_warps=4, **early,
        )
    return out


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None, reads=None) -> torch.Tensor:
    """One query token per sequence against its paged context (see kernels.reference). The kernel
    walks the block tables itself, so the CPU path's precomputed `reads` are not used."""
    return paged_decode_attention_impl(query, k_cache, v_cache, block_tables, context_lens, scale,
                                       k_scales=k_scales, v_scales=v_scales)


# ---------------------------------------------------------------------------------------------
# Prefill attention


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape of the prefill kernel: query rows and keys per tile, warps, pipeline stages,
    whether full key tiles arrive by the tensor-memory copy engine (TMA, Hopper), and whether the
    programs of one query tile run for all heads side by side (heads_fast) or one head's tiles do."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    heads_fast: bool = False


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, ks_ptr, vs_ptr, table_row, s_tn, table_width, t0, n,
    kv_end, q_pos, kvh, d, d_ok, qk_scale, s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd, ss_b, ss_o, ss_h,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    TMA: tl.constexpr, PREC: tl.constexpr, QUANT: tl.constexpr,
):
    """Fold one key tile into the running softmax of the query rows. A full tile (MASKED false)
    lies wholly before every row's position and inside the context: no mask, and with TMA its
    keys and values come by bulk copy (the tile sits inside one cache block). The diagonal and
    last tiles hide keys past each row's position and past the context. QUANT: the caches (and
    their bulk copies) hold codes, their scales at ks_ptr, vs_ptr (strides ss_*)."""
    t = t0 + n
    if MASKED:
        blk, t_ok = _tile_blocks(table_row, s_tn, table_width, t0, t, t < kv_end, BLOCK_N, BLOCK_SIZE)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        off = t % BLOCK_SIZE
        k = tl.load(k_ptr + (blk * s_kb + off * s_ko)[:, None] + kvh * s_kh + d[None, :] * s_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (blk * s_vb + off * s_vo)[:, None] + kvh * s_vh + d[None, :] * s_vd,
                    mask=kv_mask, other=0.0)
    elif TMA:  # 2-D views of the caches: [blocks * BLOCK_SIZE, kv heads * HEAD_DIM]
        blk = tl.load(table_row + (t0 // BLOCK_SIZE) * s_tn)
        row0 = blk * BLOCK_SIZE + t0 % BLOCK_SIZE
        k = k_desc.load([row0, kvh * HEAD_DIM])
        v = v_desc.load([row0, kvh * HEAD_DIM])
    else:
        blk, _ = _tile_blocks(table_row, s_tn, table_width, t0, t, t < kv_end, BLOCK_N, BLOCK_SIZE)
        off = t % BLOCK_SIZE
        k = tl.load(k_ptr + (blk * s_kb + off * s_ko)[:, None] + kvh * s_kh + d[None, :] * s_kd,
                    mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptr + (blk * s_vb + off * s_vo)[:, None] + kvh * s_vh + d[None, :] * s_vd,
                    mask=d_ok[None, :], other=0.0)
    if QUANT:  # the keys' codes as q's dtype, with their scales
        if not MASKED:
            t_ok = t < kv_end  # all true: a full tile
        off = t % BLOCK_SIZE
        k, k_scales = codes_and_scales(k, ks_ptr, blk, off, kvh, t_ok, ss_b, ss_o, ss_h, q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if QUANT:  # a key's scale multiplies its logit
        s = s * k_scales[None, :]
    if MASKED:
        s = tl.where(t_ok[None, :] & (t[None, :] <= q_pos[:, None]), s * qk_scale, float("-inf"))
        m_i, l_i, p, alpha = softmax_fold(s, m_i, l_i)
    else:  # every row sees a key here
        m_i, l_i, p, alpha = softmax_fold_all_seen(s, m_i, l_i, qk_scale)
    if QUANT:  # a value's scale weighs its probability (converted only now: fewer live registers)
        v, v_scales = codes_and_scales(v, vs_ptr, blk, off, kvh, t_ok, ss_b, ss_o, ss_h, q.dtype)
        p = weigh_by_value_scales(p, v_scales, False)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "table_width", "num_tiles", "s_tb"])  # see the decode kernel
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, ks_ptr, vs_ptr, table_ptr, cu_ptr, lens_ptr, out_ptr,
    qk_scale, num_seqs, table_width, num_tiles,
    s_qt, s_qh, s_qd,
    s_kb, s_ko, s_kh, s_kd,
    s_vb, s_vo, s_vh, s_vd,
    ss_b, ss_o, ss_h,
    s_tb, s_tn,
    s_ot, s_oh, s_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, B_PAD: tl.constexpr, PREC: tl.constexpr,
    TMA: tl.constexpr, HEADS_FAST: tl.constexpr, QUANT: tl.constexpr,
):
    """One (query tile, query head). Tiles are numbered across sequences in order; each program
    finds its sequence from cu_seqlens in-kernel (no host mapping). Surplus programs do nothing.
    Programs take tiles from the last one down: the longest rows of a causal prompt start first,
    so the short ones fill the end of the launch."""
    if HEADS_FAST:
        h = tl.program_id(0)
        tile = num_tiles - 1 - tl.program_id(1)
    else:
        tile = num_tiles - 1 - tl.program_id(0)
        h = tl.program_id(1)
    kvh = h // GROUP

    # Tiles per sequence and their running total -> this program's sequence.
    sb = tl.arange(0, B_PAD)
    sb_ok = sb < num_seqs
    cu_lo = tl.load(cu_ptr + sb, mask=sb_ok, other=0)
    cu_hi = tl.load(cu_ptr + sb + 1, mask=sb_ok, other=0)
    tiles = tl.where(sb_ok, (cu_hi - cu_lo + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    seq = tl.sum((sb_ok & (tiles_end <= tile)).to(tl.int32), axis=0)
    active = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    first_tile = tl.sum(tl.where(sb == seq, tiles_end - tiles, 0), axis=0)
    q_begin = tl.load(cu_ptr + seq)
    num_q = tl.load(cu_ptr + seq + 1) - q_begin
    ctx = tl.load(lens_ptr + seq)
    i0 = (tile - first_tile) * BLOCK_M

    i = i0 + tl.arange(0, BLOCK_M)
    row_ok = (i < num_q) & active
    q_pos = ctx - num_q + i  # KV index of each query
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rows = (q_begin + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * s_qt + h * s_qh + d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not QUANT:  # (8-bit codes are converted to the query's dtype instead)
        q = q.to(k_ptr.dtype.element_ty)

    # Keys before the tile's first row are seen by every row: full tiles, no mask. The rest, up to
    # the last row's position, are the diagonal.
    kv_end = tl.where(active, tl.minimum(ctx, ctx - num_q + i0 + BLOCK_M), 0)
    full_end = tl.where(active, (ctx - num_q + i0 + 1) // BLOCK_N * BLOCK_N, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * s_tb
    n = tl.arange(0, BLOCK_N)
    for t0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, ks_ptr, vs_ptr,
                                      table_row, s_tn, table_width, t0, n, kv_end, q_pos, kvh, d, d_ok,
                                      qk_scale, s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
                                      ss_b, ss_o, ss_h, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, TMA, PREC, QUANT)
    for t0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, ks_ptr, vs_ptr,
                                      table_row, s_tn, table_width, t0, n, kv_end, q_pos, kvh, d, d_ok,
                                      qk_scale, s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
                                      ss_b, ss_o, ss_h, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, TMA, PREC, QUANT)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * s_ot + h * s_oh + d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefill_tiles(total: int, head_dim: int, device: torch.device, itemsize: int = 2) -> PrefillTiles:
    """The launch shape for a prefill of `total` query rows of a cache with `itemsize`-byte entries
    (docs/benchmarks.md, "Prefill attention at the compute limit", has the sweep the Hopper shapes
    come from: 128 x 128 tiles for head size 128, 64 x 64 with the heads side by side for 64).
    An 8-bit cache (1 byte) takes 64-key tiles at head size 128: its codes pass through registers to
    be converted, and with 128 keys the sm_90 build spills (untimed; chosen from ptxas's usage)."""
    d_pad = max(16, next_pow2(head_dim))
    block_n = 64 if d_pad <= 128 else 32
    if total >= 128 and itemsize <= 2 and _hopper(device):
        if d_pad <= 64:
            return PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True, heads_fast=True)
        if d_pad == 128:
            return PrefillTiles(block_m=128, block_n=128 if itemsize == 2 else 64, num_warps=8, num_stages=3, tma=True)
    return PrefillTiles(block_m=64 if total >= 64 else 16, block_n=block_n,
                        num_warps=4 if d_pad <= 64 else 8, num_stages=2)


def _tma_ok(cache, head_dim: int, d_pad: int) -> bool:
    """Bulk copies of key tiles need a power-of-two head and a cache whose [blocks,
    block_size, kv_heads, head_dim] layout is contiguous (a 2-D view with 16-byte rows); the tile
    must also lie inside one cache block (the callers' check)."""
    on_device = cache.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter emulates them
    return (TensorDescriptor is not None and on_device and d_pad == head_dim and cache.is_contiguous()
            and cache.shape[2] * head_dim * cache.element_size() % 16 == 0)


def _row_view_descriptor(cache, block_n: int, head_dim: int):
    rows = cache.view(cache.shape[0] * cache.shape[1], cache.shape[2] * cache.shape[3])
    return TensorDescriptor.from_tensor(rows, [block_n, head_dim])


def prefill_attention_impl(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                           block_m: int | None = None, block_n: int | None = None,
                           tiles: PrefillTiles | None = None, k_scales=None, v_scales=None):
    total, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((total, q_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    d_pad = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    tiles = tiles or prefill_tiles(total, head_dim, query.device, k_cache.element_size())
    if block_m or block_n:
        tiles = replace(tiles, block_m=block_m or tiles.block_m, block_n=block_n or tiles.block_n)
    tma = (tiles.tma and tiles.block_n <= block_size and _tma_ok(k_cache, head_dim, d_pad)
           and _tma_ok(v_cache, head_dim, d_pad))
    if tma:
        k_desc = _row_view_descriptor(k_cache, tiles.block_n, head_dim)
        v_desc = _row_view_descriptor(v_cache, tiles.block_n, head_dim)
    else:
        k_desc, v_desc = k_cache, v_cache  # unused
    # Sum over sequences of ceil(q_i / BLOCK_M) never exceeds this (a shape-only bound).
    num_tiles = min(total, triton.cdiv(total, tiles.block_m) + num_seqs)
    grid = (q_heads, num_tiles) if tiles.heads_fast else (num_tiles, q_heads)
    ks, vs, ss_b, ss_o, ss_h, quant, prec = cache_args(query, k_cache, k_scales, v_scales)
    _prefill_kernel[grid](
        query, k_cache, v_cache, k_desc, v_desc, ks, vs, block_tables, cu_seqlens_q, context_lens, out,
        float(scale) * LOG2E, num_seqs, block_tables.shape[1], num_tiles,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), ss_b, ss_o, ss_h,
        *block_tables.stride(), *out.stride(),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, B_PAD=max(64, next_pow2(num_seqs)),  # few variants
        PREC=prec, TMA=tma, HEADS_FAST=tiles.heads_fast, QUANT=quant,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Variable-length causal attention through the block table (see kernels.reference)."""
    return prefill_attention_impl(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                  k_scales=k_scales, v_scales=v_scales)


__all__ = ["paged_decode_attention", "prefill_attention", "paged_decode_attention_impl",
           "prefill_attention_impl", "prefill_tiles", "PrefillTiles", "decode_num_partitions", "next_pow2", "num_sms",
           "dot_precision", "cache_args", "codes_and_scales"]
