"""The native CPU kernels (`kernels.c`: integer-dot products of quantized weights, and the RMSNorm,
SiLU-and-multiply, RoPE-and-store and decode attention of a quantized model's step), built with the
system's C compiler on first use and loaded through ctypes (docs/design-notes.md, "Native CPU kernels").

The library is compiled once per source, compiler and flags into a cache folder (the engine's:
$ZIPAGE_CACHE/native or ~/.cache/zipage/native), written under a temporary name and renamed into place, so
concurrent start-ups and a killed build leave no half-written file. `native_library()` returns the
loaded library, or raises `NativeUnavailable` saying why (no compiler, a failed build); callers decide
what runs instead and say so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
GROUP = 32  # values per scale, in the weights and in the quantized activations
OUT_BLOCK = 4  # a weight's output rows go four at a time: its row count must be a multiple


VECTOR_PATHS = ("portable", "AVX2", "AVX-512")  # kernels.c's zq_vector_path(), by number


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class GroupedWeight:
    """A weight [n, k] in the kernel's blocked layout (`pack_weight`): uint8 [n / 4, k / 32, group bytes];
    `bits` 4 or 8, or 6 for 8-bit codes with a scale per 16 values (LAYOUTS)."""

    blocks: torch.Tensor
    bits: int

    def __post_init__(self):
        if self.bits not in LAYOUTS or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 3 or \
                self.blocks.shape[2] != group_bytes(self.bits):
            raise ValueError(f"blocks {tuple(self.blocks.shape)} {self.blocks.dtype} are not {self.bits}-bit groups")
        if not self.blocks.is_contiguous() or self.blocks.device.type != "cpu":
            raise ValueError("a native weight is a contiguous CPU tensor")

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0] * OUT_BLOCK, self.blocks.shape[1] * GROUP


LAYOUTS = (4, 6, 8)  # kernels.c's weight layouts, by their `bits`: 6 holds 8-bit codes with two scales a group


def group_bytes(bits: int) -> int:
    """Bytes of one group of a block of OUT_BLOCK rows: float16 scales (two each for 6), float16 offsets
    (4 bits only), codes (a byte each for 6 and 8)."""
    return OUT_BLOCK * 2 * (1 if bits == 8 else 2) + OUT_BLOCK * GROUP * (4 if bits == 4 else 8) // 8


def pack_weight(values: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, bits: int) -> GroupedWeight:
    """W = values * scale + low in groups of 32 (values [n, k] integers: 0..15 for 4 bits, -128..127 for 8;
    scale and low [n, k/32], float16 values; 8-bit codes have no offset) in the kernel's layout. For 6,
    8-bit codes with a scale per 16 values: scale [n, k/16], no offset."""
    n, k = values.shape
    if n % OUT_BLOCK or k % GROUP:
        raise ValueError(f"a {n} x {k} weight is not blocks of {OUT_BLOCK} rows and groups of {GROUP}")
    if bits not in LAYOUTS:
        raise ValueError(f"no {bits}-bit layout: {LAYOUTS}")
    if (low is None) != (bits != 4):
        raise ValueError("4-bit codes take an offset per group and 8-bit ones none")
    blocks, groups = n // OUT_BLOCK, k // GROUP

    def by_group(t: torch.Tensor, width: int) -> torch.Tensor:  # [n, groups * width] -> [blocks, groups, 4 * width]
        return t.view(blocks, OUT_BLOCK, groups, width).transpose(1, 2).reshape(blocks, groups, OUT_BLOCK * width)

    def halves(t: torch.Tensor) -> torch.Tensor:
        exact = t.half()
        if not torch.equal(exact.float(), t.float()):
            raise ValueError("scales and offsets must be float16 values")
        return by_group(exact.contiguous().view(torch.uint8), 2)

    codes = by_group(pack_codes(values, bits).view(torch.uint8), GROUP * (4 if bits == 4 else 8) // 8)
    if bits == 6:  # the first halves' scales where 4 bits keep the scales, the second halves' where the offsets
        if scale.shape != (n, 2 * groups):
            raise ValueError(f"the 6 layout takes a scale per 16 values: [{n}, {2 * groups}], not {tuple(scale.shape)}")
        scale, low = scale[:, 0::2], scale[:, 1::2]
    parts = [halves(scale)] + ([halves(low)] if low is not None else []) + [codes]
    return GroupedWeight(torch.cat(parts, dim=-1).contiguous(), bits)


class LayerArgs(ctypes.Structure):
    """kernels.c's zq_layer: a decoder layer's fixed parts (weights, norms, shapes) and its step's
    (rows, RoPE rows, caches, slots, tables), field for field."""

    _fields_ = [
        ("hidden", ctypes.c_int64), ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("weights", ctypes.c_void_p * 4), ("bits", ctypes.c_int * 4), ("biases", ctypes.c_void_p * 4),
        ("rows", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("kind", ctypes.c_int), ("hadamard", ctypes.c_int),
        ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p), ("cache_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64), ("slots", ctypes.c_void_p), ("query_cache", ctypes.c_void_p),
        ("query_slots", ctypes.c_void_p), ("query_rows", ctypes.c_int64), ("block_tables", ctypes.c_void_p),
        ("table_width", ctypes.c_int64), ("context_lens", ctypes.c_void_p), ("threads", ctypes.c_int),
    ]


class NativeLibrary:
    """The loaded library: `linear(x, weight, threads)` (and `quantize(x)`, the activations' codes, for
    tests), `rms_norm`, `silu_and_mul`, `rope_store` and `decode_attention`."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.zq_quantize_rows.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
        lib.zq_quantize_rows.restype = None
        lib.zq_linear.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, i64, ptr, ctypes.c_int]
        lib.zq_linear.restype = ctypes.c_int
        lib.zq_vector_path.restype = ctypes.c_int
        lib.zq_threaded.restype = ctypes.c_int
        lib.zq_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr, ptr]
        lib.zq_rms_norm.restype = None
        lib.zq_decode_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64,
                                            i64, i64, ctypes.c_float, ptr, ctypes.c_int]
        lib.zq_decode_attention.restype = ctypes.c_int
        lib.zq_silu_and_mul.argtypes = [ptr, i64, i64, ptr]
        lib.zq_silu_and_mul.restype = None
        lib.zq_rope_store.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int, ptr, ptr, i64,
                                      ctypes.c_int, ptr, i64, ptr, ptr, i64, ptr]
        lib.zq_rope_store.restype = ctypes.c_int
        lib.zq_decode_layer.argtypes = [ctypes.POINTER(LayerArgs), ptr, ptr, ptr, ptr]
        lib.zq_decode_layer.restype = ctypes.c_int
        lib.zq_group_stride.argtypes = [ctypes.c_int]
        if any(lib.zq_group_stride(bits) != group_bytes(bits) for bits in LAYOUTS):
            raise NativeUnavailable(f"{path.name} lays out its groups unlike this module")
        self._lib = lib
        self.path = path
        lib.zq_float_min_rows.restype = ctypes.c_int
        self.vector_path = VECTOR_PATHS[lib.zq_vector_path()]
        # products of at least this many rows multiply decoded float weights by the float rows (AVX2 or
        # AVX-512); shorter ones (all, where None: the portable loops) the codes by the rows' int16 codes
        self.float_min_rows = lib.zq_float_min_rows() or None
        self.threaded = bool(lib.zq_threaded())  # False: built without OpenMP, one thread

    def reference(self, x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor,
                  low: torch.Tensor | None) -> torch.Tensor:
        """What `linear` computes, in float64 (zipage.kernels.reference): x @ W.T for W = values * scale
        + low in groups of 32 (a scale per 16 values: the 6 layout), from x's int16 codes or from x
        itself (`float_min_rows`, for the 4- and 8-bit layouts)."""
        from zipage.kernels import reference as ref

        halves = scale.shape[1] * 16 == values.shape[1]
        low = low if low is not None else torch.zeros(values.shape[0], values.shape[1] // GROUP)
        if self.float_min_rows is not None and x.shape[0] >= self.float_min_rows and not halves:
            return ref.grouped_matmul(values, scale, low, x)
        return ref.grouped_int16_matmul(values, scale, low, *ref.quantize_groups_int16(x))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 rows [m, k] -> (int16 codes [m, k], scales [m, k/32], quantized group sums [m, k/32])."""
        _require_rows(x)
        m, k = x.shape
        codes = torch.empty(m, k, dtype=torch.int16)
        scale, total = torch.empty(m, k // GROUP), torch.empty(m, k // GROUP)
        self._lib.zq_quantize_rows(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), total.data_ptr())
        return codes, scale, total

    def linear(self, x: torch.Tensor, weight: GroupedWeight, threads: int) -> torch.Tensor:
        """x @ W.T, float32 [m, n], for float32 rows x [m, k] (quantized to int16 per 32 values inside,
        but for products of `float_min_rows` rows or more)."""
        _require_rows(x)
        n, k = weight.shape
        if x.shape[1] != k:
            raise ValueError(f"rows of {x.shape[1]} values against a weight of {k} columns")
        out = torch.empty(x.shape[0], n)
        if self._lib.zq_linear(weight.blocks.data_ptr(), weight.bits, n, k, x.data_ptr(), x.shape[0],
                               out.data_ptr(), max(1, threads)):
            raise MemoryError(f"no memory for {x.shape[0]} x {k} quantized activations")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of v times weight, v) for float32 rows x [m, n], where v = x + residual when one is
        given, else x itself: the reference's rms_norm and add_rms_norm in one call."""
        _require_plain("RMSNorm", x, weight, *([residual] if residual is not None else []))
        m, n = x.shape if x.dim() == 2 else (-1, -1)
        if (residual is not None and residual.shape != x.shape) or weight.shape != (n,):
            raise ValueError(f"a norm of {tuple(weight.shape)} weights over rows {tuple(x.shape)}")
        out = torch.empty_like(x)
        summed = torch.empty_like(x) if residual is not None else x
        self._lib.zq_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              eps, m, n, out.data_ptr(), summed.data_ptr())
        return out, summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for float32 rows [m, 2n] holding gate then up: [m, n]."""
        _require_plain("SiLU-and-multiply", x)
        if x.dim() != 2 or x.shape[1] % 2:
            raise ValueError(f"expected rows of gate then up, got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], x.shape[1] // 2)
        self._lib.zq_silu_and_mul(x.data_ptr(), x.shape[0], x.shape[1] // 2, out.data_ptr())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, query_cache: torch.Tensor | None,
                   query_slot_mapping: torch.Tensor | None, k_scales: torch.Tensor | None = None,
                   v_scales: torch.Tensor | None = None, hadamard_qk: bool = False) -> torch.Tensor:
        """The reference's qk_norm_rope_store for float32 rows without q/k norms, into a float32 cache or
        an 8-bit one (codes with their scales; `cache_kind` says which layouts): q [tokens, q_heads,
        head_dim] (a new tensor). cos and sin may be rows of one table (each row contiguous, both the
        same distance apart)."""
        tokens, width = qkv.shape
        _, block_size, kv_heads, head_dim = k_cache.shape
        q_heads = width // head_dim - 2 * kv_heads
        kind = cache_kind("RoPE and store", k_cache, v_cache, k_scales, v_scales)
        _require_plain("RoPE and store", qkv, *([query_cache] if query_cache is not None else []))
        _require_plain("RoPE and store", cos[:1], sin[:1])  # rows of one table: each row contiguous
        if q_heads <= 0 or width != (q_heads + 2 * kv_heads) * head_dim or head_dim % 2 or \
                v_cache.shape != k_cache.shape or cos.shape != (tokens, head_dim) or sin.stride() != cos.stride() or \
                sin.shape != cos.shape or head_dim > MAX_HEAD or (hadamard_qk and head_dim & (head_dim - 1)):
            raise ValueError(f"qkv rows {tuple(qkv.shape)} do not fit a cache {tuple(k_cache.shape)} "
                             f"and tables {tuple(cos.shape)}")
        slots = slot_mapping.to(torch.int64).contiguous()
        query_slots = None
        if query_cache is not None and query_slot_mapping is not None:
            query_slots = query_slot_mapping.to(torch.int64).contiguous()
            if query_cache.shape[1:] != (q_heads, head_dim) or query_slots.shape != (tokens,):
                raise ValueError(f"query rows {tuple(query_slots.shape)} do not fit a query cache "
                                 f"{tuple(query_cache.shape)}")
        if slots.shape != (tokens,):
            raise ValueError(f"{tuple(slots.shape)} slots for {tokens} rows")
        q = torch.empty(tokens, q_heads, head_dim)
        if self._lib.zq_rope_store(qkv.data_ptr(), tokens, q_heads, kv_heads, head_dim, cos.data_ptr(),
                                   sin.data_ptr(), cos.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kind,
                                   _pointer(k_scales), _pointer(v_scales), block_size, int(hadamard_qk),
                                   slots.data_ptr(), k_cache.shape[0] * block_size,
                                   None if query_slots is None else query_cache.data_ptr(),
                                   None if query_slots is None else query_slots.data_ptr(),
                                   0 if query_slots is None else query_cache.shape[0], q.data_ptr()):
            raise ValueError(f"a slot outside the cache ({k_cache.shape[0] * block_size} rows) or the query cache")
        return q

    def decode_layer(self, args: LayerArgs, hidden: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's decode step in one call: (MLP output, residual stream) for float32 rows
        hidden and residual (None in the first layer), with `args` filled in for this layer and step.
        The caller owns every pointer in `args`: they must stay valid, and match its shapes."""
        out, residual_out = torch.empty_like(hidden), torch.empty_like(hidden)
        failed = self._lib.zq_decode_layer(ctypes.byref(args), hidden.data_ptr(),
                                           None if residual is None else residual.data_ptr(),
                                           out.data_ptr(), residual_out.data_ptr())
        if failed == -1:
            raise MemoryError("no memory for a decoder layer's activations")
        if failed == -2:
            raise ValueError("block tables that do not fit the cache")
        if failed == -3:
            raise ValueError("a slot outside the cache or the query cache")
        return out, residual_out

    def decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         threads: int, k_scales: torch.Tensor | None = None,
                         v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """The reference's paged_decode_attention for float32 queries and a float32 cache, or an 8-bit
        one with its scales (`cache_kind`): [batch, q_heads, head_dim]."""
        batch, q_heads, head_dim = query.shape
        _, block_size, kv_heads, cache_dim = k_cache.shape
        kind = cache_kind("decode attention", k_cache, v_cache, k_scales, v_scales)
        _require_plain("decode attention", query)
        if cache_dim != head_dim or v_cache.shape != k_cache.shape or q_heads % kv_heads:
            raise ValueError(f"queries {tuple(query.shape)} do not fit a cache {tuple(k_cache.shape)}")
        tables = block_tables.to(torch.int32).contiguous()
        lengths = context_lens.to(torch.int32).contiguous()
        if tables.dim() != 2 or tables.shape[0] != batch or lengths.shape != (batch,):
            raise ValueError(f"block tables {tuple(tables.shape)} and lengths {tuple(lengths.shape)} "
                             f"for {batch} queries")
        out = torch.empty_like(query)
        failed = self._lib.zq_decode_attention(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kind,
                                               _pointer(k_scales), _pointer(v_scales), k_cache.shape[0],
                                               tables.data_ptr(), tables.shape[1], lengths.data_ptr(), batch, q_heads,
                                               kv_heads, head_dim, block_size, scale, out.data_ptr(), max(1, threads))
        if failed == -2:
            raise ValueError(f"block tables {tuple(tables.shape)} do not hold contexts of {lengths.tolist()} "
                             f"in a cache of {k_cache.shape[0]} blocks")
        if failed:
            raise MemoryError("no memory for the attention scores")
        return out


MAX_HEAD = 512  # kernels.c's ZQ_MAX_HEAD: the widest head RoPE-and-store takes
CACHE_KINDS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.int8: 2}  # kernels.c's ZQ_FLOAT, ZQ_E4M3, ZQ_INT8


def cache_kind(what: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
               v_scales: torch.Tensor | None) -> int:
    """kernels.c's number for a cache the native kernels read or write: contiguous CPU caches [blocks,
    block_size, kv_heads, head_dim] of float32 without scales, or of 8-bit codes (fp8 or int8) with
    float32 scales [blocks, block_size, kv_heads] laid out [blocks, kv_heads, block_size] in memory
    (the engine's transposed view)."""
    kind = CACHE_KINDS.get(k_cache.dtype)
    for cache in (k_cache, v_cache):
        if cache.dtype != k_cache.dtype or kind is None or not cache.is_contiguous() or cache.device.type != "cpu":
            raise ValueError(f"native {what} takes contiguous CPU caches of float32 or 8-bit codes, not "
                             f"{tuple(cache.shape)} {cache.dtype} on {cache.device}")
    if (k_scales is None) != (kind == 0) or (v_scales is None) != (kind == 0):
        raise ValueError(f"a {k_cache.dtype} cache needs scales exactly when it holds 8-bit codes")
    for scales in (k_scales, v_scales) if kind else ():
        if scales.dtype != torch.float32 or scales.shape != k_cache.shape[:3] or \
                not scales.transpose(1, 2).is_contiguous() or scales.device.type != "cpu":
            raise ValueError(f"native {what} takes float32 scales {tuple(k_cache.shape[:3])} laid out [blocks, "
                             f"kv_heads, block_size], not {tuple(scales.shape)} {scales.dtype} strides {scales.stride()}")
    return kind


def _pointer(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _require_plain(what: str, *tensors: torch.Tensor) -> None:
    """What every kernel reads or writes through a bare pointer: contiguous float32 CPU tensors."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"native {what} takes contiguous CPU float32 tensors, not {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ' (strided)'}")


def _require_rows(x: torch.Tensor) -> None:
    _require_plain("products", x)
    if x.dim() != 2:
        raise ValueError(f"expected rows [m, k], got {tuple(x.shape)}")
    if x.shape[1] % GROUP:
        raise ValueError(f"rows of {x.shape[1]} values are not whole groups of {GROUP}")


def instruction_flags() -> list[str]:
    """The instructions torch itself runs its kernels with: AVX2, FMA and F16C for its AVX2 capability,
    and AVX-512 (F, BW, VL, DQ: what torch checks for) beside them for its AVX-512 one; else none, the
    source's portable loops. Never -march=native, which some VMs advertise beyond what they run."""
    capability = torch.backends.cpu.get_cpu_capability()
    avx2 = ["-mavx2", "-mfma", "-mf16c"] if capability in ("AVX2", "AVX512") else []
    return avx2 + (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"] if capability == "AVX512" else [])


def build(cache_dir: Path, compiler: str = "cc", defines: tuple[str, ...] = ()) -> Path:
    """Compile the source with `compiler` (a name on PATH, or a path) into `cache_dir`, once per source,
    compiler and flags; the library's path. A compiler without OpenMP (Apple's clang without libomp)
    builds it without: one thread (`NativeLibrary.threaded` says so), kept until the folder is cleared."""
    found = shutil.which(compiler)
    if found is None:
        raise NativeUnavailable(f"no C compiler: {compiler!r} is not on PATH (set CC to one)")
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    # no FP traps or errno from libm: lets the compiler vectorize loops with comparisons and inline
    # sqrtf, with the same IEEE results
    flags = ["-O3", "-std=gnu11", "-fno-trapping-math", "-fno-math-errno", "-shared", "-fPIC", *instruction_flags(),
             *(f"-D{d}" for d in defines)]
    with_openmp = ["-fopenmp", *flags]
    threaded, one_thread = _target(cache_dir, found, version, with_openmp), _target(cache_dir, found, version, flags)
    for target in (threaded, one_thread):
        if target.exists():  # built before: no compiler run at start-up, not even a failing one
            return target
    try:
        return _compile(cache_dir, found, with_openmp, threaded)
    except NativeUnavailable as openmp_failed:
        try:
            return _compile(cache_dir, found, flags, one_thread)
        except NativeUnavailable:
            raise openmp_failed from None  # what failed is the source itself: say the first error


def _target(cache_dir: Path, compiler: str, version: str, flags: list[str]) -> Path:
    """Where the library built from this source by this compiler with these flags lives."""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *flags]).encode()).hexdigest()[:16]
    return cache_dir / f"kernels-{key}.so"


def _compile(cache_dir: Path, compiler: str, flags: list[str], target: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=cache_dir, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", scratch], capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeUnavailable(f"{compiler} could not build {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(scratch, target)
        for stale in cache_dir.glob("kernels-*.so"):  # builds of older sources or other compilers
            if stale != target:
                stale.unlink(missing_ok=True)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


@functools.cache
def native_library(cache_dir: Path, compiler: str = "cc") -> NativeLibrary:
    """The library for this machine, built by `compiler` into `cache_dir` on first use and checked against
    the PyTorch reference on random data (NativeUnavailable when either fails: a wrong answer is never used)."""
    try:
        library = NativeLibrary(build(cache_dir, compiler))
    except OSError as error:
        raise NativeUnavailable(f"the native kernels could not be loaded: {error}") from error
    why = disagreement(library)
    if why:
        raise NativeUnavailable(why)
    return library


def disagreement(library: NativeLibrary) -> str | None:
    """None when every kernel matches the PyTorch reference on small random inputs, else which does not."""
    from zipage.kernels import reference as ref

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-4 * float(want.abs().max()))

    for bits in LAYOUTS:
        low_code, high_code = (0, 16) if bits == 4 else (-127, 128)
        values = torch.randint(low_code, high_code, (8, 64), generator=gen)
        scale = (torch.rand(8, 4 if bits == 6 else 2, generator=gen) * 0.1).half()
        low = (torch.randn(8, 2, generator=gen) * 0.1).half() if bits == 4 else None
        for rows in (x[:1], torch.cat([x, x, x])):  # one row, and nine: both kinds of product
            got = library.linear(rows, pack_weight(values, scale, low, bits), threads=1)
            want = library.reference(rows, values, scale, low)
            if not close(got, want):
                error = float((got - want).abs().max())
                return f"the native {bits}-bit product disagrees with the reference (max error {error:.3g})"
    weight, residual = torch.rand(64, generator=gen) + 0.5, torch.randn(3, 64, generator=gen)
    if not close(library.rms_norm(x, weight, 1e-6, residual)[0], ref.add_rms_norm(x, residual, weight, 1e-6)[0]):
        return "the native RMSNorm disagrees with the reference"
    if not close(library.silu_and_mul(x), ref.silu_and_mul(x)):
        return "the native SiLU-and-multiply disagrees with the reference"
    k_cache, v_cache = torch.randn(2, 4, 2, 8, generator=gen), torch.randn(2, 4, 2, 8, generator=gen)
    query, tables, lengths = torch.randn(2, 4, 8, generator=gen), torch.tensor([[1, 0], [0, -1]]), torch.tensor([7, 3])
    want = ref.paged_decode_attention(query, k_cache, v_cache, tables, lengths, 0.3)
    if not close(library.decode_attention(query, k_cache, v_cache, tables, lengths, 0.3, threads=1), want):
        return "the native decode attention disagrees with the reference"
    qkv, table = torch.randn(2, 64, generator=gen), torch.randn(2, 2, 8, generator=gen)
    slots = torch.tensor([5, -1])
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(4)]
    want = ref.qk_norm_rope_store(qkv, table[:, 0], table[:, 1], None, None, 0.0, caches[0], caches[1], slots,
                                  None, None)
    got = library.rope_store(qkv, table[:, 0], table[:, 1], caches[2], caches[3], slots, None, None)
    if not (close(got, want) and close(caches[2], caches[0]) and torch.equal(caches[3], caches[1])):
        return "the native RoPE-and-store disagrees with the reference"
    for dtype in (torch.float8_e4m3fn, torch.int8):  # 8-bit caches: the codes written, then read
        why = _codes_disagreement(library, dtype, qkv, table, slots, query, tables, lengths, close)
        if why:
            return why
    return None


def _codes_disagreement(library, dtype, qkv, table, slots, query, tables, lengths, close) -> str | None:
    """disagreement's check of an 8-bit cache: RoPE-and-store (int8 with the Hadamard rotation, as the
    engine runs it) writes the reference's codes and scales but where the two round a value on either
    side of a code's midpoint, and decode attention over the codes agrees with the reference's."""
    from zipage.kernels import reference as ref

    name = "fp8" if dtype == torch.float8_e4m3fn else "int8"
    rotate = dtype == torch.int8
    caches = [torch.zeros(2, 4, 2, 8).to(dtype) for _ in range(4)]
    scales = [torch.ones(2, 2, 4).transpose(1, 2) for _ in range(4)]
    want = ref.qk_norm_rope_store(qkv, table[:, 0], table[:, 1], None, None, 0.0, caches[0], caches[1], slots,
                                  None, None, k_scales=scales[0], v_scales=scales[1], hadamard_qk=rotate)
    got = library.rope_store(qkv, table[:, 0], table[:, 1], caches[2], caches[3], slots, None, None,
                             k_scales=scales[2], v_scales=scales[3], hadamard_qk=rotate)
    stored = [ref.dequantize(c, s) for c, s in zip(caches, scales)]
    step = max(float(s.max()) for s in scales) * (32 if dtype == torch.float8_e4m3fn else 1)  # a code's width
    if not close(got, want) or any(float((stored[i + 2] - stored[i]).abs().max()) > step for i in (0, 1)):
        return f"the native RoPE-and-store into an {name} cache disagrees with the reference"
    codes = {"k_cache": caches[0], "v_cache": caches[1], "k_scales": scales[0], "v_scales": scales[1]}
    want = ref.paged_decode_attention(query, block_tables=tables, context_lens=lengths, scale=0.3, **codes)
    if not close(library.decode_attention(query, block_tables=tables, context_lens=lengths, scale=0.3, threads=1,
                                          **codes), want):
        return f"the native decode attention over an {name} cache disagrees with the reference"
    return None


def pack_codes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [n, k] (0..15 for 4 bits, -127..127 for 6 and 8) in the kernel's layout: 4-bit codes two
    to a byte, code j of a group in the low nibble of byte j and code j + 16 in its high one."""
    if bits != 4:
        return values.to(torch.int8).contiguous()
    n, k = values.shape
    grouped = values.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
