"""Triton kernels for the elementwise chains of a decoder layer, one launch each: residual add +
RMSNorm, q/k RMSNorm + RoPE + K/V store (+ query-slot store), and SiLU-and-multiply.

Same signatures and semantics as `kernels.reference`. Arithmetic runs in fp32 registers and rounds
once on the store, so in bf16 results differ from the reference only by that rounding.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zipage.kernels import early_launch
from zipage.kernels.reference import hadamard
from zipage.kernels.triton_attention import next_pow2
from zipage.kernels.triton_cache import code_scale, int8_codes, quantize_codes, quantized_cache


def _row_warps(width: int) -> int:
    return 1 if width <= 256 else 4 if width <= 2048 else 8


# ---------------------------------------------------------------------------------------------
# RMSNorm, with or without the residual add


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, n,
    s_x, s_r, s_o, s_s,
    BLOCK: tl.constexpr, ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if ADD:
        # The sum is rounded to the stream's dtype first, as the reference's x + residual is.
        x = x + tl.load(res_ptr + row * s_r + cols, mask=mask, other=0.0)
        tl.store(sum_ptr + row * s_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _norm(x, residual, weight, eps):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if rows:
        block = next_pow2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, summed, eps, n,
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            BLOCK=block, ADD=residual is not None, num_warps=_row_warps(block),
        )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps)


# ---------------------------------------------------------------------------------------------
# SiLU and multiply


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, s_x, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * s_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, next_pow2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block,
                                                        num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# q/k RMSNorm + RoPE + cache stores


@triton.jit
def _quantize_head(x1, x2, scale_ptr, INT8: tl.constexpr):
    """One head given as its two halves (float32), quantized as one row: the amax spans both
    halves, so they share a scale (stored at scale_ptr). Returns the halves' quantize_codes."""
    scale = code_scale(tl.maximum(tl.max(tl.abs(x1), axis=0), tl.max(tl.abs(x2), axis=0)), INT8)
    tl.store(scale_ptr, scale)
    return quantize_codes(x1, scale, INT8), quantize_codes(x2, scale, INT8)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps,
    k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr, qc_ptr, qslot_ptr, ks_ptr, vs_ptr, had_ptr,
    s_t, s_cos, s_sin, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_qt, s_qh, s_qcr, s_qch,
    s_ksb, s_kso, s_ksh, s_vsb, s_vso, s_vsh,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, QUERY_STORE: tl.constexpr, QUANT: tl.constexpr,
    INT8: tl.constexpr, HADAMARD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (t, h): head h of token t, a query head when h < Q_HEADS, else a key head whose value
    head it also stores. The head is read as two halves, the pairs RoPE rotates together. With
    QUANT (an 8-bit cache; int8 codes with INT8) K and V are quantized per head and their scales
    stored beside them. HADAMARD: after RoPE the head is rotated by reference.hadamard(HEAD_DIM), whose
    blocks are one matrix A (had_ptr, [HEAD_DIM / 2] squared): [y1, y2] -> [(y1 + y2) A, (y1 - y2) A]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    dm = d < half
    row = qkv_ptr + t * s_t + h * HEAD_DIM
    early_launch.wait_then_release(PDL)  # for qkv
    x1 = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    x2 = tl.load(row + half + d, mask=dm, other=0.0).to(tl.float32)
    is_q = h < Q_HEADS
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        if is_q:
            w1 = tl.load(qn_ptr + d, mask=dm, other=0.0).to(tl.float32)
            w2 = tl.load(qn_ptr + half + d, mask=dm, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + d, mask=dm, other=0.0).to(tl.float32)
            w2 = tl.load(kn_ptr + half + d, mask=dm, other=0.0).to(tl.float32)
        x1 = x1 * inv * w1
        x2 = x2 * inv * w2
    # cos/sin rows repeat each frequency in both halves; the first half is enough.
    c = tl.load(cos_ptr + t * s_cos + d, mask=dm, other=0.0)
    s = tl.load(sin_ptr + t * s_sin + d, mask=dm, other=0.0)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if HADAMARD:  # (a power-of-2 head: no masked lanes)
        a = tl.load(had_ptr + d[:, None] * half + d[None, :])
        y1, y2 = tl.sum((y1 + y2)[:, None] * a, axis=0), tl.sum((y1 - y2)[:, None] * a, axis=0)
    if is_q:
        dst = q_out_ptr + t * s_qt + h * s_qh
        tl.store(dst + d, y1.to(q_out_ptr.dtype.element_ty), mask=dm)
        tl.store(dst + half + d, y2.to(q_out_ptr.dtype.element_ty), mask=dm)
        if QUERY_STORE:
            qrow = tl.load(qslot_ptr + t)
            if qrow >= 0:
                qdst = qc_ptr + qrow.to(tl.int64) * s_qcr + h * s_qch
                tl.store(qdst + d, y1.to(qc_ptr.dtype.element_ty), mask=dm)
                tl.store(qdst + half + d, y2.to(qc_ptr.dtype.element_ty), mask=dm)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            kh = h - Q_HEADS
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            if QUANT:  # masked lanes (head_dim / 2 not a power of 2) are 0: they leave the amax alone
                y1, y2 = _quantize_head(y1, y2, ks_ptr + blk * s_ksb + off * s_kso + kh * s_ksh, INT8)
            kdst = k_cache_ptr + blk * s_kb + off * s_ko + kh * s_kh
            tl.store(kdst + d, y1.to(k_cache_ptr.dtype.element_ty), mask=dm)
            tl.store(kdst + half + d, y2.to(k_cache_ptr.dtype.element_ty), mask=dm)
            vrow = row + KV_HEADS * HEAD_DIM
            vdst = v_cache_ptr + blk * s_vb + off * s_vo + kh * s_vh
            v1 = tl.load(vrow + d, mask=dm, other=0.0)
            v2 = tl.load(vrow + half + d, mask=dm, other=0.0)
            if QUANT:
                v1, v2 = _quantize_head(v1.to(tl.float32), v2.to(tl.float32),
                                        vs_ptr + blk * s_vsb + off * s_vso + kh * s_vsh, INT8)
            tl.store(vdst + d, v1.to(v_cache_ptr.dtype.element_ty), mask=dm)
            tl.store(vdst + half + d, v2.to(v_cache_ptr.dtype.element_ty), mask=dm)


@functools.lru_cache(maxsize=None)
def _hadamard_block(head_dim: int, device: torch.device) -> torch.Tensor:
    """The top-left block of the rotation: the kernel builds the rest from it."""
    return hadamard(head_dim, device)[:head_dim // 2, :head_dim // 2].contiguous()


def qk_norm_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       query_cache: torch.Tensor | None, query_slot_mapping: torch.Tensor | None,
                       k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                       hadamard_qk: bool = False) -> torch.Tensor:
    tokens = qkv.shape[0]
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    q_heads = qkv.shape[1] // head_dim - 2 * kv_heads
    q = torch.empty((tokens, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    if (qkv.stride(1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or cos.stride(1) != 1
            or sin.stride(1) != 1):
        raise ValueError("qk_norm_rope_store needs unit stride along head_dim")
    norm = q_norm is not None
    query_store = query_slot_mapping is not None
    qc = query_cache if query_store else q
    qc_strides = (query_cache.stride(0), query_cache.stride(1)) if query_store else (0, 0)
    quant = quantized_cache(k_scales, v_scales)
    scales = (k_scales, v_scales) if quant else (q, q)  # unused pointers without QUANT
    scale_strides = (*k_scales.stride(), *v_scales.stride()) if quant else (0,) * 6
    had = _hadamard_block(head_dim, qkv.device) if hadamard_qk else q
    _qk_norm_rope_store_kernel[(tokens, q_heads + kv_heads)](
        qkv, cos, sin, q_norm if norm else qkv, k_norm if norm else qkv, eps,
        k_cache, v_cache, slot_mapping, q, qc, query_slot_mapping if query_store else slot_mapping, *scales, had,
        qkv.stride(0), cos.stride(0), sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], q.stride(0), q.stride(1),
        *qc_strides, *scale_strides,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF_PAD=next_pow2(head_dim // 2),
        BLOCK_SIZE=block_size, NORM=norm, QUERY_STORE=query_store, QUANT=quant,
        INT8=int8_codes(k_cache), HADAMARD=hadamard_qk, num_warps=1, **early_launch.launch_args(qkv.device),
    )
    return q
