"""The 8-bit KV cache's Triton writers against kernels.reference, run on the CPU with the Triton
interpreter (TRITON_INTERPRET=1): store_kv and qk_norm_rope_store quantize each (token, KV head)
row into codes, float8_e4m3fn or symmetric int8, and a float32 scale; compact_kv moves codes and
scales untouched. Every test runs for both code dtypes (CODE_DTYPES).

The interpreter's own float32 -> fp8 cast is wrong; triton_ops.patch_interpreter_for_numpy2 sends it
through torch's cast, which rounds to nearest even like the GPU's cvt.rn.satfinite. int8 codes are
rounded (ties to even) by the kernels' own arithmetic before the cast, which would truncate. The
kernels' arithmetic is then checked bit for bit against the reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from zipage.kernels import reference as ref  # noqa: E402
from zipage.kernels import triton_ops  # noqa: E402

triton_ops.patch_interpreter_for_numpy2()

from zipage.kernels import triton_cache as tcache  # noqa: E402
from zipage.kernels import triton_fused as tfused  # noqa: E402

FP8, INT8 = torch.float8_e4m3fn, torch.int8
CODE_DTYPES = [FP8, INT8]  # the 8-bit caches' codes (ref.CODE_MAX)
by_code = pytest.mark.parametrize("codes_dtype", CODE_DTYPES, ids=["fp8", "int8"])


def fp8_values() -> torch.Tensor:
    """Every finite, non-negative e4m3 value in ascending order."""
    values = torch.arange(128, dtype=torch.uint8).view(FP8).float()
    return values[torch.isfinite(values)]


def code_values(dtype) -> torch.Tensor:
    """Every non-negative code value of the dtype, ascending: e4m3's finite values, or 0..127."""
    return fp8_values() if dtype == FP8 else torch.arange(128).float()


def random_codes(shape, gen, dtype) -> torch.Tensor:
    """Stale cache contents: random codes of the dtype (for fp8 the NaN codes 0x7f, 0xff left out;
    for int8 every byte, -128 included, is something a stale slot may hold)."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if dtype == FP8:
        raw = torch.where(raw % 128 == 127, raw - 1, raw)
    return raw.view(dtype)


def engine_layout(scales: torch.Tensor) -> torch.Tensor:
    """The same scales [..., blocks, block_size, kv_heads] stored as the engine stores them: each
    head's scales of a block contiguous (a transposed view), so kernels must read them by stride."""
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def nearest_even(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (already in code units) as codes, independently of kernels.reference: torch's fp8 cast
    rounds to nearest even, and torch.round rounds half to even."""
    return x.to(FP8) if dtype == FP8 else x.round().to(INT8)


def awkward_rows(tokens, kv_heads, head_dim, gen, dtype) -> torch.Tensor:
    """[tokens, kv_heads, head_dim] float32 rows of very different magnitudes, with the cases that
    matter planted: an all-zero row (token 1), a row with one large outlier (token 2: the rest land
    near or below the smallest codes), and rows of exact rounding ties between neighbouring codes
    of the dtype (for fp8 normal and subnormal; for int8 k + 0.5), of both signs: token 3 with amax
    CODE_MAX (scale 1), token 4 the same times 7 (scale 7: x / scale is exact, x * (1 / scale) often
    is not)."""
    x = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    x *= torch.exp(3 * torch.randn(tokens, kv_heads, 1, generator=gen))
    x[1, 0] = 0.0
    x[2, -1, head_dim // 3] = 4e4 * x[2, -1].abs().max()
    values = code_values(dtype)
    ties = (values[1:] + values[:-1]) / 2
    picked = ties[torch.randint(0, len(ties), (head_dim,), generator=gen)]
    signs = torch.where(torch.rand(head_dim, generator=gen) < 0.5, -1.0, 1.0)
    x[3, 0] = signs * picked
    x[3, 0, 5] = -ref.CODE_MAX[dtype]
    x[4, 0] = 7 * x[3, 0]
    return x


ROUND_TRIP = {FP8: 2.0 ** -4, INT8: (0.5 + 1e-4) / ref.INT8_MAX}  # of a row's amax: half a step, and then some


def check_round_trip(codes, scales, x):
    """Dequantized entries are within half a step of x: for e4m3 at most amax * 2**-4 per row, for
    int8 half a code (amax / 254)."""
    err = (ref.dequantize(codes, scales) - x.float()).abs()
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    assert bool((err <= amax * ROUND_TRIP[codes.dtype]).all())


def test_interpreter_fp8_cast_rounds_to_nearest_even():
    """The cast the kernels' stores use, as the interpreter runs it here, is the exact one: every
    e4m3 value, every tie between neighbours (to the even code), the float32 values either side of
    each tie, and values just under a power of two that round up into the next binade."""

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(y_ptr + i, x.to(y_ptr.dtype.element_ty), mask=i < n)

    values = fp8_values()
    ties = (values[1:] + values[:-1]) / 2
    below, above = torch.nextafter(ties, ties - 1), torch.nextafter(ties, ties + 1)
    edges = 2.0 ** torch.arange(-9, 9).float() * (1 - 2 ** -5)
    x = torch.cat([values, ties, below, above, edges])
    x = torch.cat([x, -x])
    y = torch.empty(x.numel(), dtype=FP8)
    cast[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(bits(y), bits(x.to(FP8)))
    spot = torch.tensor([8.5, 9.5, 7.94, 126.24, 2.0 ** -10, 3 * 2.0 ** -10])  # ties to even; carries
    out = torch.empty(spot.numel(), dtype=FP8)
    cast[(1,)](spot, out, spot.numel(), BLOCK=8)
    assert out.float().tolist() == [8.0, 10.0, 8.0, 128.0, 0.0, 2.0 ** -8]


def test_reference_int8_quantization_by_hand():
    """quantize_rows for int8, spelled out on small rows: scale amax / 127; ties k + 0.5 to the even
    code (not away from zero, not truncated); the amax on -127, never -128; an all-zero row scale 1."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],
                      [-127.0, -126.5, 125.5, 0.49, -0.51, 3.7, -3.7, 0.0],
                      [0.0] * 8,
                      [-254.0, 127.0, 125.0, 1.0, -1.0, 3.0, -3.0, 0.0]])
    codes, scales = ref.quantize_rows(x, INT8)
    assert codes.dtype == INT8 and scales.dtype == torch.float32
    assert scales.tolist() == [1.0, 1.0, 1.0, 2.0]
    assert codes[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert codes[1].tolist() == [-127, -126, 126, 0, -1, 4, -4, 0]
    assert codes[2].tolist() == [0] * 8
    assert codes[3].tolist() == [-127, 64, 62, 0, 0, 2, -2, 0]  # x / 2: every odd one a tie, to even


STORE_CASES = [  # (head_dim, kv_heads, block_size, input dtype)
    (64, 1, 16, torch.float32), (128, 2, 16, torch.float32), (64, 3, 256, torch.float32),
    (128, 4, 256, torch.bfloat16), (64, 4, 16, torch.bfloat16),
]


@by_code
@pytest.mark.parametrize("head_dim,kv_heads,block_size,dtype", STORE_CASES)
def test_store_kv_8bit(head_dim, kv_heads, block_size, dtype, codes_dtype):
    """Codes and scales exactly the reference's; slots of -1 and every other slot untouched; the
    stored entries dequantize to within the codes' rounding of the input; every row's amax on the
    largest code (448, or 127)."""
    gen = torch.Generator().manual_seed(head_dim + 10 * kv_heads + block_size)
    tokens, num_blocks = 21, 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 7, 20]] = -1
    key = awkward_rows(tokens, kv_heads, head_dim, gen, codes_dtype).to(dtype)
    both = torch.cat([awkward_rows(tokens, kv_heads, head_dim, gen, codes_dtype), key.float()], dim=-1).to(dtype)
    value = both[..., :head_dim]  # a strided view
    assert not value.is_contiguous()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = random_codes(shape, gen, codes_dtype), random_codes(shape, gen, codes_dtype)
    k_scales, v_scales = engine_layout(torch.rand(shape[:3], generator=gen)), engine_layout(torch.rand(shape[:3], generator=gen))
    before = [t.clone() for t in (k_cache, v_cache, k_scales, v_scales)]
    expected = [t.clone() for t in before]
    ref.store_kv(key, value, expected[0], expected[1], slots, k_scales=expected[2], v_scales=expected[3])
    tcache.store_kv(key, value, k_cache, v_cache, slots, k_scales=k_scales, v_scales=v_scales)

    assert k_cache.dtype == codes_dtype
    assert torch.equal(bits(k_cache), bits(expected[0])) and torch.equal(bits(v_cache), bits(expected[1]))
    torch.testing.assert_close(k_scales, expected[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(v_scales, expected[3], rtol=1e-6, atol=0)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for after, old in zip((k_cache, v_cache, k_scales, v_scales), before):
        flat_after, flat_old = after.flatten(0, 1), old.flatten(0, 1)
        if after.dtype == codes_dtype:
            flat_after, flat_old = bits(flat_after), bits(flat_old)
        assert torch.equal(flat_after[~written], flat_old[~written])
    kept = slots >= 0
    rows = slots[kept]
    for cache, scales, x in ((k_cache, k_scales, key), (v_cache, v_scales, value)):
        stored, stored_scales = cache.flatten(0, 1)[rows], scales.flatten(0, 1)[rows]
        check_round_trip(stored, stored_scales, x[kept])
        zero = x[kept].float().abs().amax(dim=-1) == 0
        assert zero.any() and bool((stored_scales[zero] == 1).all())
        assert bool((stored[zero].float() == 0).all())
        top = ref.CODE_MAX[codes_dtype]
        assert bool((stored.float().abs().amax(dim=-1)[~zero] == top).all())  # amax lands on 448 (127)
        if codes_dtype == INT8:
            assert int(stored.min()) >= -127  # symmetric: -128 is never written


@by_code
def test_store_kv_ties_and_outliers_are_exact(codes_dtype):
    """The planted rows, spelled out, in the reference and in the Triton store: an all-zero row is
    codes 0 with scale 1; in the rows of ties (scales 1 and 7) each element rounds to the even
    neighbour; an outlier's code is the largest one (448, or 127)."""
    gen = torch.Generator().manual_seed(5)
    head_dim = 64
    key = awkward_rows(5, 1, head_dim, gen, codes_dtype)
    value = key.clone()
    shape = (1, 16, 1, head_dim)
    k_cache, v_cache = random_codes(shape, gen, codes_dtype), random_codes(shape, gen, codes_dtype)
    k_scales, v_scales = torch.rand(1, 16, 1, generator=gen), torch.rand(1, 16, 1, generator=gen)
    tcache.store_kv(key, value, k_cache, v_cache, torch.arange(5), k_scales=k_scales, v_scales=v_scales)
    ref_codes, ref_scales = ref.quantize_rows(key[:, 0], codes_dtype)
    for codes, scales in ((k_cache[0, :5, 0], k_scales[0, :5, 0]), (ref_codes, ref_scales)):
        assert scales[1] == 1 and bool((bits(codes[1]) == 0).all())
        assert scales[3] == 1 and scales[4] == 7
        assert torch.equal(bits(codes[3]), bits(nearest_even(key[3, 0], codes_dtype)))
        assert torch.equal(bits(codes[4]), bits(codes[3]))
        tied = torch.arange(head_dim) != 5  # element 5 is the row's amax, the largest code (odd for int8)
        assert bool((codes[3, tied].float() != key[3, 0, tied]).all())  # the rest were all ties,
        assert bool(((bits(codes[3, tied]) & 1) == 0).all())  # and every tie went to the even code
        assert codes[3, 5].float() == -ref.CODE_MAX[codes_dtype]
        outlier = key[2, 0].abs().argmax()
        assert codes[2, outlier].float().abs() == ref.CODE_MAX[codes_dtype]
    assert torch.equal(bits(v_cache[0, :5]), bits(k_cache[0, :5])) and torch.equal(v_scales[0, :5], k_scales[0, :5])


def test_store_kv_int8_never_writes_minus_128():
    """Rows whose largest magnitude is negative, with amaxes where float32's amax / (amax / 127)
    comes out just above 127: the amax's code is exactly -127 (clamped, then rounded), in the
    reference and the Triton store alike; and no code of many random rows is -128."""
    gen = torch.Generator().manual_seed(17)
    tokens, head_dim = 32, 64
    amax = torch.rand(4096, generator=gen) * 10 + 0.01
    over = amax[amax / (amax / 127) > 127][:tokens]  # the division overshoots 127 by an ulp
    assert over.numel() == tokens
    x = (torch.rand(tokens, 1, head_dim, generator=gen) * 2 - 1) * over[:, None, None]
    where = torch.randint(0, head_dim, (tokens,), generator=gen)
    x[torch.arange(tokens), 0, where] = -over
    x = torch.cat([x, torch.randn(tokens, 1, head_dim, generator=gen) * 5], dim=0)
    shape = (4, 16, 1, head_dim)
    k_cache = torch.full(shape, -128, dtype=INT8)  # stale -128 everywhere, so a skipped write shows too
    v_cache = k_cache.clone()
    k_scales, v_scales = torch.ones(shape[:3]), torch.ones(shape[:3])
    tcache.store_kv(x, -x, k_cache, v_cache, torch.arange(2 * tokens), k_scales=k_scales, v_scales=v_scales)
    ref_codes, _ = ref.quantize_rows(x[:, 0], INT8)
    triton_codes = k_cache.flatten(0, 1)[:2 * tokens, 0]
    for codes in (ref_codes, triton_codes, v_cache.flatten(0, 1)[:2 * tokens, 0]):
        assert int(codes.min()) >= -127 and int(codes.max()) <= 127
    for codes in (ref_codes, triton_codes):
        assert codes[torch.arange(tokens), where].tolist() == [-127] * tokens
    assert torch.equal(triton_codes, ref_codes)


def test_int8_round_trip_beats_fp8_on_gaussian_rows():
    """A property of the formats, through the Triton store: on Gaussian rows int8's uniform step
    (amax / 127) loses less than e4m3's 3 mantissa bits (about 4x less in relative norm, and every
    row better: int8 at most 0.009, fp8 at least 0.021); on a row with one huge outlier the order
    flips (int8 zeroes the rest, fp8 keeps them in its subnormals): the trade-off int8 makes."""
    gen = torch.Generator().manual_seed(23)
    tokens, kv_heads, head_dim = 48, 2, 128
    x = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    x *= torch.exp(torch.randn(tokens, kv_heads, 1, generator=gen))  # rows of different magnitudes
    outlier = torch.randn(1, kv_heads, head_dim, generator=gen)
    outlier[0, :, 7] = 4e4
    x = torch.cat([x, outlier])
    row_error, total_error = {}, {}
    for dtype in CODE_DTYPES:
        shape = (4, 16, kv_heads, head_dim)
        k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        k_scales, v_scales = torch.ones(shape[:3]), torch.ones(shape[:3])
        tcache.store_kv(x, x, k_cache, v_cache, torch.arange(tokens + 1), k_scales=k_scales, v_scales=v_scales)
        error = ref.dequantize(k_cache, k_scales).flatten(0, 1)[:tokens + 1] - x
        row_error[dtype] = error.norm(dim=-1) / x.norm(dim=-1)
        total_error[dtype] = float(error[:tokens].norm() / x[:tokens].norm())
    assert total_error[INT8] < total_error[FP8] / 3, total_error  # measured: 0.0071 against 0.027
    assert bool((row_error[INT8][:tokens] < row_error[FP8][:tokens]).all())
    assert bool((row_error[INT8][tokens:] > row_error[FP8][tokens:]).all())  # the outlier rows: fp8 keeps more


def rope_inputs(tokens, q_heads, kv_heads, head_dim, gen):
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 8, generator=gen)[:, 3:3 + width]  # a strided view
    qkv *= torch.exp(2 * torch.randn(tokens, 1, generator=gen))
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    v[1, 0] = 0.0  # an all-zero V row
    v[2, -1, head_dim - 1] = 1e4  # an outlier in V's second half
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((positions[:, None].float() * inv_freq,) * 2, dim=-1)
    rows = torch.stack((emb.cos(), emb.sin()), dim=1)  # the engine's layout: strided views
    return qkv, rows[:, 0], rows[:, 1]


def code_step(codes: torch.Tensor) -> torch.Tensor:
    """The gap from each code to its neighbour away from zero: e4m3's, or 1 for int8."""
    if codes.dtype == INT8:
        return torch.ones(codes.shape)
    return 2.0 ** (torch.floor(torch.log2(codes.float().abs().clamp(min=2.0 ** -6))) - 3)


QK_CASES = [(2, 64, 2, 16), (1, 128, 1, 256), (2, 128, 4, 16), (4, 64, 3, 16), (1, 48, 2, 16)]
# int8: three heads (padded rows), a block of 256, masked lanes; the two plainest shapes left to fp8
QK_CASES_INT8 = [(4, 64, 3, 16), (1, 128, 1, 256), (1, 48, 2, 16)]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("group,head_dim,kv_heads,block_size,codes_dtype",
                         [(*c, FP8) for c in QK_CASES] + [(*c, INT8) for c in QK_CASES_INT8],
                         ids=[f"{name}-" + "-".join(map(str, c)) for name, cases in (("fp8", QK_CASES),
                                                                                   ("int8", QK_CASES_INT8))
                              for c in cases])
def test_qk_norm_rope_store_8bit(norm, group, head_dim, kv_heads, block_size, codes_dtype):
    """q (and the query cache) exactly as with a plain cache; K/V codes and scales exactly the
    reference's quantize_rows of the kernel's own float32 K/V (one amax over both rotary halves);
    against the whole reference, V bit for bit and K up to the kernel's float32 RoPE/norm rounding.
    head_dim 48 leaves masked lanes in each half."""
    gen = torch.Generator().manual_seed(13 + head_dim + kv_heads + norm)
    tokens, q_heads, num_blocks = 9, kv_heads * group, 3
    qkv, cos, sin = rope_inputs(tokens, q_heads, kv_heads, head_dim, gen)
    q_norm = torch.rand(head_dim, generator=gen) + 0.5 if norm else None
    k_norm = torch.rand(head_dim, generator=gen) + 0.5 if norm else None
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 6]] = -1
    qslots = torch.tensor([3, -1, 0, 11, -1, 5, 6, -1, 1])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # 8-bit caches, and the scales as layer views of a [layers, 2, ...] tensor as the engine holds them
    caches = random_codes((2, 2) + shape, gen, codes_dtype)
    scales = torch.rand((2, 2) + shape[:3], generator=gen)
    qcache = torch.randn(12, q_heads, head_dim, generator=gen)
    expected = [caches.clone(), scales.clone(), qcache.clone()]
    args = (qkv, cos, sin, q_norm, k_norm, 1e-6)
    q = tfused.qk_norm_rope_store(*args, caches[1, 0], caches[1, 1], slots, qcache, qslots,
                                  k_scales=scales[1, 0], v_scales=scales[1, 1])
    q_ref = ref.qk_norm_rope_store(*args, expected[0][1, 0], expected[0][1, 1], slots, expected[2], qslots,
                                   k_scales=expected[1][1, 0], v_scales=expected[1][1, 1])
    # The same kernel on a float32 cache: its q, and the K/V values it would store.
    plain_k, plain_v = torch.zeros(shape), torch.zeros(shape)
    plain_qcache = expected[2].clone()
    plain_q = tfused.qk_norm_rope_store(*args, plain_k, plain_v, slots, plain_qcache, qslots)

    assert torch.equal(q, plain_q) and torch.equal(qcache, plain_qcache)
    torch.testing.assert_close(q, q_ref, rtol=1e-4, atol=1e-5)
    rows = slots[slots >= 0]
    for i, plain in enumerate((plain_k, plain_v)):
        codes, row_scales = ref.quantize_rows(plain.flatten(0, 1)[rows], codes_dtype)
        assert torch.equal(bits(caches[1, i].flatten(0, 1)[rows]), bits(codes))
        assert torch.equal(scales[1, i].flatten(0, 1)[rows], row_scales)
        check_round_trip(caches[1, i].flatten(0, 1)[rows], row_scales, plain.flatten(0, 1)[rows])
    # Nothing else written: other layers, the other slots.
    assert torch.equal(bits(caches[0]), bits(expected[0][0])) and torch.equal(scales[0], expected[1][0])
    assert torch.equal(bits(caches[1, 1]), bits(expected[0][1, 1]))  # V: no arithmetic, so bit-exact
    assert torch.equal(scales[1, 1], expected[1][1, 1])
    torch.testing.assert_close(scales, expected[1], rtol=1e-6, atol=0)
    if not norm:  # RoPE alone is the same float32 products as the reference: bit-exact
        assert torch.equal(bits(caches[1, 0]), bits(expected[0][1, 0]))
    else:  # the kernel's RMS sum rounds differently from torch.rms_norm: a rare code one step off
        k_codes, k_ref = caches[1, 0].float(), expected[0][1, 0].float()
        differ = k_codes != k_ref
        assert bool(((k_codes - k_ref).abs() <= code_step(expected[0][1, 0])).all())
        assert differ.float().mean() < 1e-3


@by_code
@pytest.mark.parametrize("kv_heads,block_size,head_dim", [(1, 16, 64), (2, 16, 128), (3, 16, 64), (4, 256, 64)])
@pytest.mark.parametrize("with_tables", [True, False])
def test_compact_kv_8bit_overlapping(kv_heads, block_size, head_dim, with_tables, codes_dtype):
    """Targets are blocks the kept entries come from: each kept entry's codes and scale land in
    its target slot bit for bit (gathered before anything is written), the score, position and
    choice tables move as before, and every slot outside the targets is untouched."""
    gen = torch.Generator().manual_seed(kv_heads * 100 + block_size + head_dim)
    num_blocks = 6
    shape = (num_blocks, block_size, kv_heads, head_dim)
    scales = engine_layout(torch.rand((2, 2) + shape[:3], generator=gen))  # layer views, as the engine holds them
    other_layer = scales[0].clone()
    k_cache, v_cache = random_codes(shape, gen, codes_dtype), random_codes(shape, gen, codes_dtype)
    k_scales, v_scales = scales[1, 0], scales[1, 1]
    slots = num_blocks * block_size
    score_cache = torch.randn(slots, kv_heads, generator=gen)
    position_cache = torch.randperm(slots, generator=gen).int()[:, None].repeat(1, kv_heads)
    choice_cache = torch.randn(slots, kv_heads, generator=gen)
    table = torch.tensor([3, 0, 5, 1])
    kv_len = 3 * block_size + block_size // 2
    keep = 2 * block_size
    token_slots = (table[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:kv_len]
    src = token_slots[ref.keep_indices(torch.randn(kv_heads, kv_len, generator=gen), keep)]
    targets = [0, 3]  # the first two blocks of the sequence, both sources
    dst = torch.tensor([b * block_size + o for b in targets for o in range(block_size)])
    kept_scores = torch.randn(kv_heads, keep, generator=gen)
    kept_choices = torch.randn(kv_heads, keep, generator=gen)
    tables = (score_cache, position_cache, choice_cache) if with_tables else (None, None, None)
    before = [t.clone() for t in (k_cache, v_cache, k_scales, v_scales, score_cache, position_cache, choice_cache)]
    expected = [t.clone() for t in before]
    exp_tables = expected[4:] if with_tables else (None, None, None)
    ref.compact_kv(expected[0], expected[1], exp_tables[0], src, dst, kept_scores, exp_tables[1], exp_tables[2],
                   kept_choices, k_scales=expected[2], v_scales=expected[3])
    tcache.compact_kv(k_cache, v_cache, tables[0], src, dst, kept_scores, tables[1], tables[2], kept_choices,
                      k_scales=k_scales, v_scales=v_scales)

    heads = torch.arange(kv_heads)[None, :]
    for after, old in zip((k_cache, v_cache, k_scales, v_scales), before):
        flat_after, flat_old = after.flatten(0, 1), old.flatten(0, 1)
        if after.dtype == codes_dtype:
            flat_after, flat_old = bits(flat_after), bits(flat_old)
        assert torch.equal(flat_after[dst[:, None], heads], flat_old[src.t(), heads])  # moved as they were
        others = torch.ones(slots, dtype=torch.bool)
        others[dst] = False
        assert torch.equal(flat_after[others], flat_old[others])
    assert k_cache.dtype == codes_dtype
    assert torch.equal(bits(k_cache), bits(expected[0])) and torch.equal(bits(v_cache), bits(expected[1]))
    assert torch.equal(k_scales, expected[2]) and torch.equal(v_scales, expected[3])
    assert torch.equal(scales[0], other_layer)
    if with_tables:
        for after, exp in zip(tables, exp_tables):
            assert torch.equal(after, exp)
        assert torch.equal(position_cache[dst[:, None], heads], before[5][src.t(), heads])


@pytest.mark.parametrize("codes_dtype", [FP8, INT8, torch.float32, torch.bfloat16],
                         ids=["fp8", "int8", "float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads,block_size,head_dim,kv_len", [(2, 16, 64, 57), (3, 16, 80, 64), (4, 256, 64, 300)])
def test_gather_kv_dequantizes_in_one_pass(codes_dtype, dtype, kv_heads, block_size, head_dim, kv_len):
    """One sequence's entries through a shuffled block table, in logical order: the Triton gather
    gives the reference's values bit for bit, an 8-bit cache's dequantized (codes times their
    scale in float32, then cast to `dtype`) from scales read by stride, a float cache's as they
    are; nothing past kv_len is read into the output."""
    gen = torch.Generator().manual_seed(kv_heads * 1000 + block_size + head_dim + kv_len)
    num_blocks = 7
    shape = (num_blocks, block_size, kv_heads, head_dim)
    eight_bit = codes_dtype in (FP8, INT8)
    if eight_bit:
        cache = random_codes(shape, gen, codes_dtype)
        scales = engine_layout(torch.rand(shape[:3], generator=gen) * 3)
    else:
        cache = torch.randn(shape, generator=gen).to(codes_dtype)
        scales = None
    table = torch.randperm(num_blocks, generator=gen)[:-(-kv_len // block_size) + 1]  # one block to spare
    out = tcache.gather_kv(cache, table, kv_len, scales, dtype)
    expected = ref.gather_kv(cache, table, kv_len, scales, dtype)
    assert out.shape == (kv_len, kv_heads, head_dim)
    assert out.dtype == expected.dtype == (dtype or (torch.float32 if eight_bit else codes_dtype))
    assert torch.equal(out, expected)
    # in logical order: entry t is slot t % block_size of block table[t // block_size]
    t = kv_len - 1
    row = cache[table[t // block_size], t % block_size].float()
    if eight_bit:
        row = row * scales[table[t // block_size], t % block_size][:, None]
    assert torch.equal(out[t], row.to(out.dtype))


def test_hadamard_is_an_orthonormal_rotation_of_power_of_2_heads():
    for n in (1, 2, 16, 64, 128):
        h = ref.hadamard(n)
        assert h.shape == (n, n) and h.dtype == torch.float32
        torch.testing.assert_close(h @ h.T, torch.eye(n), rtol=0, atol=1e-6)
        assert bool((h.abs() == n ** -0.5).all())  # every channel spread evenly over all of them
    for n in (0, 48, 96):
        with pytest.raises(ValueError, match="power-of-2"):
            ref.hadamard(n)


@pytest.mark.parametrize("head_dim,norm", [(64, True), (128, False)])
def test_qk_norm_rope_store_rotated_keeps_every_logit(head_dim, norm):
    """hadamard_qk: the Triton kernel's rotated q, query-cache rows and int8 K/V codes against the
    reference's; and in both, every q·k (prefill attention over what was stored) is what it was
    without the rotation, while the stored keys themselves differ."""
    gen = torch.Generator().manual_seed(5 + head_dim)
    tokens, kv_heads, group, block_size = 9, 2, 2, 16
    q_heads = kv_heads * group
    qkv, cos, sin = rope_inputs(tokens, q_heads, kv_heads, head_dim, gen)
    weights = [torch.rand(head_dim, generator=gen) + 0.5 if norm else None for _ in range(2)]
    slots = torch.randperm(2 * block_size, generator=gen)[:tokens]
    shape = (2, block_size, kv_heads, head_dim)

    def store(impl, codes_dtype, rotate):
        k = torch.zeros(shape, dtype=codes_dtype)
        v = torch.zeros_like(k)
        scales = {} if codes_dtype == torch.float32 else dict(k_scales=torch.ones(shape[:3]), v_scales=torch.ones(shape[:3]))
        qcache = torch.zeros(tokens, q_heads, head_dim)
        q = impl(qkv, cos, sin, *weights, 1e-6, k, v, slots, qcache, torch.arange(tokens), hadamard_qk=rotate, **scales)
        return q, qcache, k, v, scales

    q, qcache, k, v, scales = store(tfused.qk_norm_rope_store, INT8, True)
    q_ref, qcache_ref, k_ref, v_ref, scales_ref = store(ref.qk_norm_rope_store, INT8, True)
    torch.testing.assert_close(q, q_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(qcache, q)
    assert torch.equal(v, v_ref)  # values are not rotated
    assert bool(((k.int() - k_ref.int()).abs() <= 1).all())  # float32 sums in another order: a tie may part
    torch.testing.assert_close(scales["k_scales"], scales_ref["k_scales"], rtol=1e-5, atol=0)

    # The rotation leaves attention as it was (float32 caches: no rounding in between).
    table = torch.arange(2, dtype=torch.int32)[None].expand(tokens, 2).contiguous()
    ctx = torch.full((tokens,), 2 * block_size, dtype=torch.int32)
    outs, keys = [], []
    for rotate in (False, True):
        q32, _, k32, v32, _ = store(ref.qk_norm_rope_store, torch.float32, rotate)
        keys.append(k32)
        outs.append(ref.paged_decode_attention(q32, k32, v32, table, ctx, head_dim ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(keys[0], keys[1])
