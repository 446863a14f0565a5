"""Skinny matrix products for decode: y = x @ W.T for at most MAX_ROWS rows of x.

With so few rows a product is a stream over W; cuBLAS reaches 2.7-4.1 TB/s on a decoder's
projections and far less on small matrices, against 4.25 TB/s for a device copy. Here each
program owns BLOCK_N output columns (W rows) and loops over K in BLOCK_K tiles loaded as contiguous
vectors, accumulating in fp32. Where N gives too few programs to fill the GPU, K is split and the
last program of a column tile to finish sums the partials in a fixed order (deterministic, one
launch; a per-tile counter, reset by that program, tells who is last).

The x tile can be computed in the prologue instead of read: the RMSNorm of x (after the residual
add, whose sum the first column tile writes out, each element once) or SiLU(gate) * up. That
folds the elementwise kernels before the QKV, gate/up and down projections into the products
(FOLD_MAX_ROWS says when the engine does).

Nothing syncs with the host and every shape comes from tensor sizes, so decode CUDA graphs capture
these kernels. Same signatures and semantics as `kernels.reference`; more than MAX_ROWS rows go to
cuBLAS (after the fused elementwise kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from zipage.kernels import early_launch, triton_fused
from zipage.kernels.triton_attention import dot_precision, next_pow2, num_sms

MAX_ROWS = 16  # x rows a skinny product takes; above this, cuBLAS's tiles fill up

PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3  # prologues: how the x tile is made


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split_k: int = 1
    dot: bool = True  # tensor-core tl.dot on x padded to 16 rows; else broadcast-multiply-and-sum
    num_warps: int = 4
    num_stages: int = 3


# The fastest of ~100 candidates per shape on the H200 (bf16, weights cold in L2, back-to-back in a
# CUDA graph; benchmarks/gpu_skinny.py), keyed on (N, K) of the Qwen3-0.6B and -8B projections:
# (config for one row, config for 2-16 rows). The 0.6B gate/up and down one-row configs were then
# chosen inside the early-launched chain of a step's products (docs/design-notes.md, "Model":
# one-row product tiles are chosen where they run).
TABLE: dict[tuple[int, int], tuple[Config, Config]] = {
    (4096, 1024): (Config(16, 512, dot=False), Config(32, 128, num_stages=5)),  # qwen3-0.6b qkv
    (1024, 2048): (Config(32, 256, split_k=8, num_stages=5), Config(32, 256, split_k=8)),  # qwen3-0.6b o
    (6144, 1024): (Config(16, 256, dot=False), Config(64, 128, num_stages=5)),  # qwen3-0.6b gate_up
    (1024, 3072): (Config(16, 512, split_k=8, dot=False), Config(32, 128, split_k=4, num_stages=5)),  # qwen3-0.6b down
    (6144, 4096): (Config(16, 512, dot=False), Config(64, 512)),  # qwen3-8b qkv
    (4096, 4096): (Config(64, 128, split_k=4), Config(32, 256, num_stages=5)),  # qwen3-8b o
    (24576, 4096): (Config(16, 256, dot=False), Config(64, 128)),  # qwen3-8b gate_up
    (4096, 12288): (Config(64, 128, split_k=8), Config(32, 256, num_stages=5)),  # qwen3-8b down
}


# Products of at most this many rows fold their norm or SiLU into the prologue; larger ones run
# the elementwise kernel first. Measured end to end on the H200 (docs/benchmarks.md): one decode
# row through folded products ran a Qwen3-0.6B step 1.28x faster than cuBLAS (863 against 676
# tok/s) and a Qwen3-8B step no slower (201 against 199); with 4 and 16 rows the 8B shape ran at
# 0.65x, so only single rows fold (and take the skinny path at all: kernels.SKINNY_MAX_ROWS).
FOLD_MAX_ROWS = 1


def pick_config(n: int, k: int, rows: int, device: torch.device) -> Config:
    entry = TABLE.get((n, k))
    if entry is not None:
        return entry[0] if rows == 1 else entry[1]
    # Elsewhere: 32-column tiles, and split K until the GPU has two programs per SM.
    block_n, block_k = 32, 256
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * num_sms(device) and k >= 4 * block_k * split and split < 8:
        split *= 2
    return Config(block_n, block_k, split)


# Early launch (zipage.kernels.early_launch): a product's programs start while the kernel before it
# finishes, ask L2 for their first weights, and wait for x there. Only products of at most this many
# bytes launch so (Qwen3-0.6B's: 7% off its chain of products); larger ones (Qwen3-8B's) ran no
# faster that way and slower with the prefetch (docs/benchmarks.md, "Products that start early").
PDL_MAX_BYTES = 16 << 20
PDL_PREFETCH_LINES = 16  # 128-byte lines of each weight row asked for before the wait


def pdl_prefetch_lines(weight: torch.Tensor) -> int:
    """Weight lines per row a product asks L2 for before it waits on the kernel before it, or -1
    where it launches the plain way (early launch off or unavailable, a large product)."""
    if weight.numel() * weight.element_size() > PDL_MAX_BYTES or not early_launch.available(weight.device):
        return -1
    return PDL_PREFETCH_LINES


# ---------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _x_side(x_rows, r_rows, nw_ptr, ks, k_ok, K, PROLOGUE: tl.constexpr):
    """The loads a prologue makes for one K tile: (x, the residual or up half, the norm weight).
    Always masked: they also prefetch one tile past the program's range."""
    a = tl.load(x_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
    if PROLOGUE == 3:
        b = tl.load(x_rows + K + ks[None, :], mask=k_ok[None, :], other=0.0)
    elif PROLOGUE == 2:
        b = tl.load(r_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
    else:
        b = a
    if PROLOGUE == 1 or PROLOGUE == 2:
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0)
    else:
        nw = tl.zeros([ks.shape[0]], a.dtype)
    return a, b, nw


@triton.jit
def _accumulate(acc, x, w, DOT: tl.constexpr, PREC: tl.constexpr):
    if DOT:
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    else:  # broadcast-multiply-and-sum: [rows, BLOCK_N, BLOCK_K], summed over K after the loop
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ptrs (one request per element), without waiting for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])  # one binary for 1-16 rows
def _skinny_kernel(
    x_ptr, r_ptr, nw_ptr, sum_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, k_split, eps,
    s_xm, s_rm, s_sm, s_wn, s_ym,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, DOT: tl.constexpr,
    PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr = False, PF_LINES: tl.constexpr = 0,
):
    """Program (n, s): output columns n * BLOCK_N.. of every row, over K columns s * k_split.. .

    RMSNorm is linear in x up to a per-row scale: the tile is multiplied by the norm weight only,
    the sum of squares is gathered in the same loop, and the scale 1/rms is applied to the
    accumulator at the end (after the split-K sum). No pass over x ahead of the product."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = w_ptr.dtype.element_ty
    NORMS: tl.constexpr = PROLOGUE == 1 or PROLOGUE == 2
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    rm = tl.minimum(m, M - 1).to(tl.int64)  # padding rows repeat the last row, never stored
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * s_wn  # no masks on W rows
    x_rows = x_ptr + rm[:, None] * s_xm
    r_rows = r_ptr + rm[:, None] * s_rm
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    if PF_LINES > 0:
        # Launched while the kernel before it finishes: fetch the first of this program's weights
        # (which no kernel writes) towards L2, then wait for that kernel's x.
        line: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        cols = k_lo + tl.arange(0, PF_LINES) * line
        prefetch_l2(w_rows + tl.minimum(cols, k_hi - 1)[None, :])
    early_launch.wait_then_release(PDL)
    if DOT:
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([M_PAD, BLOCK_K], tl.float32)

    if PROLOGUE == 0:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :])
                x = tl.load(x_rows + ks[None, :])
            else:
                k_ok = ks < k_hi
                w = tl.load(w_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
                x = tl.load(x_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
            acc = _accumulate(acc, x, w, DOT, PREC)
    else:
        # The x side is loaded one tile ahead: its latency hides behind this tile's work, as the
        # compiler's pipelining hides W's.
        a, b, nw = _x_side(x_rows, r_rows, nw_ptr, k_lo + kk, k_lo + kk < k_hi, K, PROLOGUE)
        writer = pid_n == 0  # the column tiles of split 0.. write the residual sum, once each
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + kk
            k_ok = ks < k_hi
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :])
            else:
                w = tl.load(w_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
            na, nb, nnw = _x_side(x_rows, r_rows, nw_ptr, ks + BLOCK_K, ks + BLOCK_K < k_hi, K, PROLOGUE)
            if PROLOGUE == 3:  # x holds gate then up, K columns each
                gate = a.to(tl.float32)
                x = (gate / (1.0 + tl.exp(-gate)) * b.to(tl.float32)).to(dtype)
            else:
                if PROLOGUE == 2:
                    # rounded to the stream's dtype first, as the reference's x + residual is
                    a = a + b
                    tl.store(sum_ptr + rm[:, None] * s_sm + ks[None, :], a,
                             mask=writer & m_ok[:, None] & k_ok[None, :])
                af = a.to(tl.float32)
                sq += af * af
                x = (af * nw.to(tl.float32)[None, :]).to(dtype)
            acc = _accumulate(acc, x, w, DOT, PREC)
            a, b, nw = na, nb, nnw
    if not DOT:
        acc = tl.sum(acc, axis=2)
    sumsq = tl.sum(sq, axis=1)

    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        # Partials (and the slices' sums of squares) to the workspace; the last program of this
        # column tile to arrive sums them in order.
        part = ws_ptr + m[:, None] * N + rn[None, :]
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        sq_part = ws_ptr + SPLIT_K * M * N + pid_n * SPLIT_K * M + m  # per column tile: no waiting on others
        if NORMS:
            tl.store(sq_part + pid_k * M, sumsq, mask=m_ok)
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
            sumsq = tl.zeros([M_PAD], tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if NORMS:
                    sumsq += tl.load(sq_part + s * M, mask=m_ok, other=0.0, cache_modifier=".cg")
            _finish(acc, sumsq, K, eps, b_ptr, y_ptr, m, rn, n_ok, out_mask, s_ym, NORMS, HAS_BIAS)
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next product (and graph replay)
    else:
        _finish(acc, sumsq, K, eps, b_ptr, y_ptr, m, rn, n_ok, out_mask, s_ym, NORMS, HAS_BIAS)


@triton.jit
def _finish(acc, sumsq, K, eps, b_ptr, y_ptr, m, rn, n_ok, out_mask, s_ym,
            NORMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    if NORMS:
        acc = acc * tl.rsqrt(sumsq / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# ---------------------------------------------------------------------------------------------
# Launch

COUNTER_SLOTS = 1 << 14  # column tiles a split-K product may have
_counters: dict[torch.device, torch.Tensor] = {}


def _counter_buffer(device: torch.device) -> torch.Tensor | None:
    """The split-K arrival counters of this device, zero between products. Made on first use,
    which must not be inside a graph capture (the engine's warm-up forward comes first); None then."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int = PLAIN,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0, config: Config | None = None,
                  pdl: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x' @ weight.T + bias, the residual sum or None) for x [M <= MAX_ROWS, K'] where x' is x
    through the prologue (K' = 2K for SILU_MUL). x's rows must be contiguous; the sum is a new tensor."""
    rows = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != (2 * k if prologue == SILU_MUL else k):
        raise ValueError(f"x has {x.shape[1]} columns for a weight of {k}")
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1..{MAX_ROWS} rows, got {rows}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("skinny_matmul needs unit stride along K")
    cfg = config or pick_config(n, k, rows, x.device)
    pdl = pdl_prefetch_lines(weight) if pdl is None else pdl
    split = cfg.split_k
    tiles = triton.cdiv(n, cfg.block_n)
    counters = _counter_buffer(x.device) if split > 1 and tiles <= COUNTER_SLOTS else None
    if counters is None:
        split = 1
    k_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # no empty splits
    even_k = k % cfg.block_k == 0
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if prologue == ADD_NORM else None
    # split-K: the partial products, then each (column tile, split)'s sums of squares of the rows
    ws = torch.empty(split * rows * (n + tiles), dtype=torch.float32, device=x.device) if split > 1 else y
    r = residual if residual is not None else x
    s = summed if summed is not None else x
    _skinny_kernel[(tiles, split)](
        x, r, norm_weight if norm_weight is not None else weight, s, weight,
        bias if bias is not None else weight, y, ws, counters if counters is not None else y,
        rows, n, k, k_split, eps,
        x.stride(0), r.stride(0), s.stride(0), weight.stride(0), y.stride(0),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, M_PAD=16 if cfg.dot else next_pow2(rows),
        DOT=cfg.dot, PREC=dot_precision(x.dtype), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        EVEN_K=even_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({**early_launch.LAUNCH_ARGS, "PF_LINES": pdl} if pdl >= 0 else {}),
    )
    return y, summed


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, K] with contiguous rows when the skinny kernel takes it, else None."""
    x2 = x.reshape(-1, x.shape[-1])
    if not 0 < x2.shape[0] <= MAX_ROWS:
        return None
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _fits(x2: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return x2 is not None and weight.dtype == x2.dtype and weight.stride(-1) == 1


# ---------------------------------------------------------------------------------------------
# The reference's signatures


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = _rows(x)
    if not _fits(x2, weight):
        return F.linear(x, weight, bias)
    return skinny_matmul(x2, weight, bias)[0].view(*x.shape[:-1], weight.shape[0])


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x)
    if (_fits(x2, weight) and x.dim() == 2 and x2.shape[0] <= FOLD_MAX_ROWS
            and (residual is None or residual.stride(-1) == 1)):
        if residual is None:
            return skinny_matmul(x2, weight, bias, NORM, None, norm_weight, eps)[0], x
        return skinny_matmul(x2, weight, bias, ADD_NORM, residual, norm_weight, eps)
    if residual is None:
        return linear(triton_fused.rms_norm(x, norm_weight, eps), weight, bias), x
    normed, summed = triton_fused.add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), summed


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = _rows(x)
    if _fits(x2, weight) and x.dim() == 2 and x2.shape[0] <= FOLD_MAX_ROWS:
        return skinny_matmul(x2, weight, bias, SILU_MUL)[0]
    return linear(triton_fused.silu_and_mul(x), weight, bias)


# ---------------------------------------------------------------------------------------------
# Weights warmed in L2 ahead of the products that read them (one-row decode steps on CUDA)
#
# A one-row step of a small model streams each projection's weights once, but its chain of products,
# attention and norms leaves memory idle between products: Qwen3-0.6B's 112 products move 0.88 GB at
# about 1.5 TB/s, a third of what the device copies. A side stream, forked from the step's stream
# before each product, asks L2 for the weights of the product WARM_AHEAD products later. It writes
# nothing, so the step computes the same bits; the forward joins it before returning, so a captured
# CUDA graph holds both branches. WARM_AHEAD 0 leaves it off until timed on a GPU (gpu_decode.py's
# warm-l2-N variants; gpu_check.py checks the tokens). See docs/design-notes.md, "Model".

WARM_AHEAD = 0  # products between the one a fork precedes and the one whose weights it warms (0: off)
WARM_MAX_BYTES = 16 << 20  # only models whose every product is this small: a few of them fit L2 together
WARM_LINES_PER_PROGRAM = 1024  # 128-byte lines a program asks for


@triton.jit
def _warm_l2_kernel(ptr, n_lines, LINES: tl.constexpr):
    """Ask L2 for LINES 128-byte lines from ptr (bytes) on; the last program repeats the last line."""
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    prefetch_l2(ptr + tl.minimum(lines, n_lines - 1).to(tl.int64) * 128)


def warm_l2(weight: torch.Tensor) -> None:
    """Launch the requests for weight's bytes on the current stream (nothing waits for them)."""
    data = weight.detach().reshape(-1).view(torch.uint8)
    lines = triton.cdiv(data.numel(), 128)
    _warm_l2_kernel[(triton.cdiv(lines, WARM_LINES_PER_PROGRAM),)](data, lines, LINES=WARM_LINES_PER_PROGRAM, num_warps=4)


def warm_order(count: int, ahead: int) -> list[list[int]]:
    """For each of `count` products in turn, the products whose weights are warmed just before it:
    the first `ahead + 1` before the first, then the one `ahead` later before each."""
    if count <= 0 or ahead <= 0:
        return [[] for _ in range(max(count, 0))]
    return [list(range(min(ahead + 1, count)))] + [[k + ahead] if k + ahead < count else []
                                                  for k in range(1, count)]


_side_streams: dict[int, torch.cuda.Stream] = {}


class WeightWarmer:
    """One forward's warming: call `before_product()` just before each product, in the order of
    `weights`, then `join()` before the forward returns."""

    forks = 0  # side-stream launches made (captures and eager forwards), for checks that it ran

    def __init__(self, weights: list[torch.Tensor], ahead: int):
        self.weights = weights
        self.order = warm_order(len(weights), ahead)
        self.next = 0
        device = weights[0].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(device=device)
        self.side = _side_streams[index]

    def before_product(self) -> None:
        due = self.order[self.next] if self.next < len(self.order) else []
        self.next += 1
        if not due:
            return
        self.side.wait_stream(torch.cuda.current_stream())  # after what the step launched so far
        with torch.cuda.stream(self.side):
            for k in due:
                warm_l2(self.weights[k])
        WeightWarmer.forks += 1

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)


def weight_warmer(weights) -> WeightWarmer | None:
    """A warmer for a forward over these product weights (an iterable, in their order; read only when
    warming is on), or None where it is off: WARM_AHEAD 0, not NVIDIA CUDA, or a product over
    WARM_MAX_BYTES (whose weights L2 cannot hold ahead)."""
    if WARM_AHEAD <= 0:
        return None
    weights = list(weights)
    if not weights or weights[0].device.type != "cuda" or torch.version.hip is not None:
        return None
    if max(w.numel() * w.element_size() for w in weights) > WARM_MAX_BYTES:
        return None
    return WeightWarmer(weights, WARM_AHEAD)
