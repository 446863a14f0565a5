"""The native CPU products (zipage/kernels/cpu, docs/design-notes.md "Native CPU kernels"): activations
quantized exactly as the PyTorch reference does, products against the float64 reference and the
dequantized weight for both widths and every row pattern, in the vector build (and its AVX2 products
where that build's are AVX-512) and the portable one, real GGUF blocks, the RMSNorm, SiLU-and-multiply,
RoPE-and-store and decode attention beside them, and the refusals (bad layouts, no compiler, a failed
build); a compiler without OpenMP builds a one-thread library."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from zipage.engine.execution.models.quantized import Kernels, WeightReport
from zipage.engine.loading.gguf_tensors import NATIVE_BITS, QuantizedTensor
from zipage.kernels.cpu.native import GroupedWeight, NativeLibrary, NativeUnavailable, build, disagreement, pack_weight
from zipage.kernels.reference import (add_rms_norm, paged_decode_attention, qk_norm_rope_store,
                                     quantize_groups_int16, quantize_rows, rms_norm, silu_and_mul)


CAPABILITY = torch.backends.cpu.get_cpu_capability()
VECTOR_PATH = {"AVX2": "AVX2", "AVX512": "AVX-512"}.get(CAPABILITY, "portable")


@pytest.fixture(scope="module", params=["vector", "portable"] + (["avx2"] if VECTOR_PATH == "AVX-512" else []))
def products(request, tmp_path_factory) -> NativeLibrary:
    """The library as this machine builds it, its portable loops (what a CPU without AVX2 runs), and
    its AVX2 products where the vector build's are AVX-512."""
    defines = {"vector": (), "avx2": ("ZQ_NO_AVX512",), "portable": ("ZQ_PORTABLE",)}[request.param]
    lib = NativeLibrary(build(tmp_path_factory.mktemp("native"), defines=defines))
    assert lib.vector_path == {"vector": VECTOR_PATH, "avx2": "AVX2", "portable": "portable"}[request.param]
    assert lib.threaded
    return lib


def random_weight(n: int, k: int, bits: int, gen: torch.Generator):
    """(integer codes, float16 scales, float16 offsets or None) of a random grouped weight (layout 6:
    Q6_K's codes, a scale per 16 values)."""
    low_code, high_code = {4: (0, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
    values = torch.randint(low_code, high_code, (n, k), generator=gen)
    scale = (torch.rand(n, k // (16 if bits == 6 else 32), generator=gen) * 0.02 + 1e-3).half()
    low = (torch.randn(n, k // 32, generator=gen) * 0.05).half() if bits == 4 else None
    return values, scale, low


def dequantized(values, scale, low) -> torch.Tensor:
    n, k = values.shape
    group = k // scale.shape[1]
    w = values.double().view(n, k // group, group) * scale.double()[..., None]
    if low is not None:
        w = w + low.double()[..., None]
    return w.view(n, k)


def test_activations_quantize_exactly_as_the_reference(products):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=gen) * 3
    x[1, 32:64] = 0  # an all-zero group: codes 0, scale 0
    x[2, :32] = torch.arange(32) - 15.5  # halves after scaling: ties go to even
    x[3, 64:96] = 1e-30  # tiny values
    codes, scale, total = products.quantize(x)
    want_codes, want_scale, want_total = quantize_groups_int16(x)
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert torch.equal(total, want_total)
    assert int(codes.abs().max()) == 32767 and float(scale[1, 1]) == 0.0


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_the_product_matches_the_reference_for_every_row_pattern(products, bits, rows):
    gen = torch.Generator().manual_seed(10 * bits + rows)
    values, scale, low = random_weight(64, 256, bits, gen)
    x = torch.randn(rows, 256, generator=gen)
    got = products.linear(x, pack_weight(values, scale, low, bits), threads=1)
    want = products.reference(x, values, scale, low)
    assert got.dtype == torch.float32 and got.shape == (rows, 64)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # and against the weight itself times the float activations: the int16 rounding of x is all it adds
    # (int8 activations would be ~5e-3 off)
    exact = x.double() @ dequantized(values, scale, low).T
    assert float((got.double() - exact).norm() / exact.norm()) < 1e-3


def test_threads_split_the_outputs_without_changing_a_bit(products):
    gen = torch.Generator().manual_seed(3)
    values, scale, low = random_weight(96, 512, 4, gen)
    weight, x = pack_weight(values, scale, low, 4), torch.randn(3, 512, generator=gen)
    assert torch.equal(products.linear(x, weight, threads=1), products.linear(x, weight, threads=2))


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(products, bits):
    gen = torch.Generator().manual_seed(6)
    values, scale, low = random_weight(32, 192, bits, gen)
    weight, x = pack_weight(values, scale, low, bits), torch.randn(21, 192, generator=gen)
    # a product of `float_min_rows` rows or more (AVX-512: 4, AVX2: 8) is a float one (layouts 4 and 8),
    # of fewer the int16 dots: rows agree bit for bit within each kind, and across them where there is one
    assert products.float_min_rows == {"portable": None, "AVX2": 8, "AVX-512": 4}[products.vector_path]
    least = products.float_min_rows or 8
    few, many = products.linear(x[:least - 1], weight, threads=1), products.linear(x, weight, threads=1)
    for start, stop in ((0, 1), (1, 3), (2, least - 1)):
        assert torch.equal(products.linear(x[start:stop], weight, threads=1), few[start:stop])
    for start, stop in ((0, least), (3, least + 5), (21 - least - 1, 21)):
        assert torch.equal(products.linear(x[start:stop], weight, threads=1), many[start:stop])
    if products.float_min_rows is None or bits == 6:
        assert torch.equal(few, many[:least - 1])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q6_K"])
def test_real_gguf_blocks_give_the_dequantized_product(products, qtype):
    rng = np.random.default_rng(4)
    cols = 512 if qtype == "Q6_K" else 320  # K-quants come in super-blocks of 256
    if qtype == "Q6_K":  # the gguf package cannot quantize to it: random blocks with a sane d
        blocks = rng.integers(0, 256, (48, cols // 256, 210), dtype=np.uint8)
        blocks[..., 208:] = np.array([0.002], dtype=np.float16).view(np.uint8)
        tensor = QuantizedTensor(qtype, (48, cols), blocks.reshape(48, -1))
    else:
        values = (rng.standard_normal((48, cols)) * 0.05).astype(np.float32)
        tensor = QuantizedTensor(qtype, (48, cols), quants.quantize(values, GGMLQuantizationType[qtype]))
    groups = tensor.groups()
    bits = NATIVE_BITS[qtype]
    # Q6_K's scales (d times an int8) are rounded to float16, as the engine packs them
    weight = pack_weight(groups.codes, groups.scale.half().float(), groups.low if bits == 4 else None, bits)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(5))
    want = x.double() @ tensor.dequantize().double().T
    got = products.linear(x, weight, threads=2)
    assert float((got.double() - want).norm() / want.norm()) < 1e-3


@pytest.mark.parametrize("rows,size", [(1, 576), (3, 100), (2, 5)])  # sizes past and short of 8 lanes
def test_the_rms_norm_matches_the_reference(products, rows, size):
    gen = torch.Generator().manual_seed(rows * size)
    x, residual = torch.randn(rows, size, generator=gen) * 3, torch.randn(rows, size, generator=gen)
    weight = torch.rand(size, generator=gen) + 0.5
    normed, same = products.rms_norm(x, weight, 1e-5)
    assert same is x and torch.allclose(normed, rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)
    normed, summed = products.rms_norm(x, weight, 1e-5, residual)
    want_normed, want_summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed) and torch.allclose(normed, want_normed, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="a norm of"):
        products.rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        products.rms_norm(x.double(), weight, 1e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_silu_and_mul_matches_the_reference(products, rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    x[0, :3] = torch.tensor([-100.0, 0.0, 100.0])  # saturated gates: silu's tails
    assert torch.allclose(products.silu_and_mul(x), silu_and_mul(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rows of gate then up"):
        products.silu_and_mul(x[:, :-1].contiguous())


def paged_context(lengths: list[int], gen: torch.Generator, block_size: int = 16, kv_heads: int = 3,
                  head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, context_lens): each sequence's blocks drawn at random from a
    shared pool, tables padded with -1."""
    need = [-(-n // block_size) for n in lengths]
    pool = sum(need) + 4
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    tables = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    start = 0
    for row, count in enumerate(need):
        tables[row, :count] = order[start:start + count]
        start += count
    return k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("lengths", [[1], [200], [5, 37, 100, 16], [150] * 8])
def test_decode_attention_matches_the_reference(products, lengths):
    gen = torch.Generator().manual_seed(sum(lengths))
    k_cache, v_cache, tables, context = paged_context(lengths, gen)
    query = torch.randn(len(lengths), 9, 64, generator=gen)  # 3 query heads per KV head
    if len(lengths) == 4:
        tables[2, 1] = -1  # a hole (a block not yet re-filled after a compaction): skipped
    want = paged_decode_attention(query, k_cache, v_cache, tables, context, 0.125)
    got = products.decode_attention(query, k_cache, v_cache, tables, context, 0.125, threads=2)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # a sequence's answer is the same bits alone as in its batch
    alone = products.decode_attention(query[-1:], k_cache, v_cache, tables[-1:], context[-1:], 0.125, threads=1)
    assert torch.equal(alone, got[-1:])


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("with_queries", [False, True])
def test_rope_and_store_match_the_reference(products, tokens, with_queries):
    gen = torch.Generator().manual_seed(tokens)
    q_heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    table = torch.stack((torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)), dim=1)
    cos, sin = table[:, 0], table[:, 1]  # rows of one table, as the model's RotaryEmbedding gives them
    slots = torch.randperm(4 * block_size, generator=gen)[:tokens]
    slots[0] = -1  # skipped: not stored
    query_slots = torch.full((tokens,), -1)
    query_slots[-1] = 2
    caches = [torch.zeros(4, block_size, kv_heads, head_dim) for _ in range(4)]
    queries = [torch.zeros(3, q_heads, head_dim) for _ in range(2)]
    keep = (lambda t: t) if with_queries else (lambda t: None)
    want = qk_norm_rope_store(qkv, cos, sin, None, None, 0.0, caches[0], caches[1], slots, keep(queries[0]),
                              keep(query_slots))
    got = products.rope_store(qkv, cos, sin, caches[2], caches[3], slots, keep(queries[1]), keep(query_slots))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(caches[2], caches[0], rtol=1e-5, atol=1e-6) and torch.equal(caches[3], caches[1])
    assert torch.allclose(queries[1], queries[0], rtol=1e-5, atol=1e-6)
    assert bool(caches[2].any()) == (tokens > 1) and bool(queries[1].any()) == with_queries
    bad = slots.clone()
    bad[-1] = 4 * block_size  # past the cache: refused before anything is written
    before = caches[2].clone()
    with pytest.raises(ValueError, match="a slot outside the cache"):
        products.rope_store(qkv, cos, sin, caches[2], caches[3], bad, None, None)
    assert torch.equal(caches[2], before)


@pytest.mark.parametrize("head_dim", [128, 80])  # two register passes of 64 values; a width that takes neither
def test_decode_attention_of_other_head_widths_matches_the_reference(products, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache, tables, context = paged_context([37, 100], gen, kv_heads=2, head_dim=head_dim)
    query = torch.randn(2, 4, head_dim, generator=gen)
    want = paged_decode_attention(query, k_cache, v_cache, tables, context, head_dim ** -0.5)
    got = products.decode_attention(query, k_cache, v_cache, tables, context, head_dim ** -0.5, threads=2)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_what_does_not_fit(products):
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, tables, context = paged_context([40], gen)
    query = torch.randn(1, 9, 64, generator=gen)
    with pytest.raises(ValueError, match="block tables"):
        products.decode_attention(query, k_cache, v_cache, tables, torch.tensor([10_000]), 0.125, threads=1)
    with pytest.raises(ValueError, match="do not fit a cache"):
        products.decode_attention(torch.randn(1, 8, 64), k_cache, v_cache, tables, context, 0.125, threads=1)
    past = tables.clone()
    past[0, 0] = k_cache.shape[0]  # a block the cache does not have
    with pytest.raises(ValueError, match="block tables"):
        products.decode_attention(query, k_cache, v_cache, past, context, 0.125, threads=1)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        products.decode_attention(query.double(), k_cache, v_cache, tables, context, 0.125, threads=1)


def test_bad_layouts_and_inputs_are_refused(products):
    gen = torch.Generator().manual_seed(6)
    values, scale, low = random_weight(8, 64, 4, gen)
    with pytest.raises(ValueError, match="not blocks of 4 rows"):
        pack_weight(values[:6], scale[:6], low[:6], 4)
    with pytest.raises(ValueError, match="float16 values"):
        pack_weight(values, scale.float() + 1e-5, low, 4)
    with pytest.raises(ValueError, match="4-bit codes take an offset"):
        pack_weight(values, scale, None, 4)
    with pytest.raises(ValueError, match="are not 8-bit groups"):
        GroupedWeight(pack_weight(values, scale, low, 4).blocks, 8)
    with pytest.raises(ValueError, match="a scale per 16 values"):
        pack_weight(values, scale, None, 6)
    with pytest.raises(ValueError, match="no 5-bit layout"):
        pack_weight(values, scale, None, 5)
    weight = pack_weight(values, scale, low, 4)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        products.linear(torch.randn(2, 64).double(), weight, threads=1)
    with pytest.raises(ValueError, match="rows of 96 values against a weight of 64 columns"):
        products.linear(torch.randn(2, 96), weight, threads=1)
    with pytest.raises(ValueError, match="whole groups of 32"):
        products.linear(torch.randn(2, 40), weight, threads=1)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        products.linear(torch.randn(64, 2).T, weight, threads=1)  # not contiguous


def test_no_compiler_or_a_failed_build_is_said_plainly(tmp_path):
    with pytest.raises(NativeUnavailable, match="no C compiler: 'no-such-compiler' is not on PATH"):
        build(tmp_path, "no-such-compiler")
    with pytest.raises(NativeUnavailable, match="could not build kernels.c"):
        build(tmp_path, "false")  # a compiler that fails
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


def test_a_compiler_without_openmp_builds_a_one_thread_library(tmp_path):
    # what Apple's clang without libomp does with -fopenmp: refuse it
    compiler = tmp_path / "cc-without-openmp"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "unsupported option -fopenmp" >&2; '
                        'exit 1; }; done\nexec cc "$@"\n')
    compiler.chmod(0o755)
    lib = NativeLibrary(build(tmp_path / "native", str(compiler), defines=("ZQ_PORTABLE",)))
    assert not lib.threaded and disagreement(lib) is None
    x, (values, scale, low) = torch.randn(3, 64), random_weight(8, 64, 4, torch.Generator().manual_seed(5))
    weight = pack_weight(values, scale, low, 4)
    assert torch.equal(lib.linear(x, weight, threads=2), lib.linear(x, weight, threads=1))
    report = WeightReport()  # and the weight report says why its products run on one thread
    Kernels(native=lib, int4=True).note(report, {"Q4_1"})
    assert report.notes == {"integer dots run on one thread: the C compiler has no OpenMP (set CC to one that has, "
                            "e.g. clang with libomp)"}


def test_a_build_is_kept_once_and_replaces_older_ones(tmp_path):
    first = build(tmp_path, defines=("ZQ_PORTABLE",))
    assert build(tmp_path, defines=("ZQ_PORTABLE",)) == first and first.stat().st_size > 0  # built once
    second = build(tmp_path)  # other flags: a new library, and the older one goes
    assert sorted(p.name for p in tmp_path.iterdir()) == [second.name]


def test_the_start_up_check_catches_a_wrong_kernel(products, monkeypatch):
    assert disagreement(products) is None
    monkeypatch.setattr(products, "rms_norm", lambda x, weight, eps, residual=None: (x * 1.001, x))
    assert disagreement(products) == "the native RMSNorm disagrees with the reference"
    monkeypatch.setattr(products, "linear", lambda x, weight, threads: torch.zeros(x.shape[0], weight.shape[0]))
    assert disagreement(products).startswith("the native 4-bit product disagrees with the reference")


def test_which_kernel_runs_which_weight_and_why_not():
    here, bare = Kernels.here(), Kernels(native=None, int4=False, why_native="no C compiler")
    assert here.native is not None  # a C compiler is part of the test machine's set-up
    assert here.short_form({"Q4_1"}, 64) == ("native", None)
    assert here.short_form({"Q8_0"}, 64) == ("native", None)
    assert here.short_form({"Q4_K"}, 64) == ("native", None)
    assert here.short_form({"Q5_0"}, 64) == ("native", None)
    assert here.short_form({"Q4_1"}, 6) == (None, "integer dots need a multiple of 4 output rows, not 6; "
                                                  "the int4 kernel needs a multiple of 16 output rows, not 6")
    # fused parts run fused where their codes share a width: Q5_0 and Q8_0 both as 8-bit codes
    assert here.short_form({"Q5_0", "Q8_0"}, 64) == ("native", None)
    assert here.short_form({"Q4_0", "Q4_K"}, 64) == ("native", None)
    # and parts of different layouts a product each (QuantizedWeights packs them apart)
    assert here.short_form({"Q4_1", "Q8_0"}, 64) == ("native", None)
    assert here.short_form({"Q4_K", "Q6_K"}, 64) == ("native", None)
    assert here.short_form({"Q4_1", "Q5_1"}, 64) == (None, "the fused parts are stored in different types")
    assert Kernels(native=None, int4=True).short_form({"Q4_K", "Q6_K"}, 64) == (
        None, "no integer dots here; the fused parts are stored in different types")
    assert here.short_form({"Q5_1"}, 64) == (None, "no CPU kernel for Q5_1 blocks")
    assert bare.short_form({"Q8_0"}, 64) == (None, "no integer dots here; PyTorch's int8 kernel takes one scale per "
                                                   "row, Q8_0 has one per 32 values")
    assert bare.short_form({"Q5_0", "Q8_0"}, 64) == (None, "no integer dots here; PyTorch's int8 kernel takes one "
                                                           "scale per row, Q5_0+Q8_0 has one per 32 values")
    assert bare.short_form({"Q4_0"}, 64) == (None, "no integer dots here; this torch has no working int4 CPU kernel")
    assert Kernels(native=None, int4=True).short_form({"Q4_0", "Q4_K"}, 64) == ("int4", None)


# ---------------------------------------------------------------------------------------------
# 8-bit caches: codes and scales written by RoPE-and-store, read by decode attention


FP8, INT8 = torch.float8_e4m3fn, torch.int8
CODE_TOP = {FP8: 448.0, INT8: 127.0}


def coded_caches(blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Empty K/V codes and their scales [blocks, block_size, kv_heads], laid out as the engine lays
    them out ([blocks, kv_heads, block_size] in memory)."""
    codes = [torch.zeros(blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2)]
    scales = [torch.ones(blocks, kv_heads, block_size).transpose(1, 2) for _ in range(2)]
    return codes, scales


def rounding_cases(dtype: torch.dtype, gen: torch.Generator, count: int) -> torch.Tensor:
    """Values |x| <= top that test a rounding: every code's value and every midpoint between two codes
    (ties), subnormals and random values at every scale."""
    if dtype == FP8:
        values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
        values = values[values.isfinite() & (values >= 0)].unique()
    else:
        values = torch.arange(0, 128).float()
    midpoints = (values[1:] + values[:-1]) / 2
    random = torch.rand(count, generator=gen) * CODE_TOP[dtype] * torch.rand(count, generator=gen) ** 6
    pool = torch.cat([values, midpoints, random])
    signs = torch.where(torch.rand(pool.shape, generator=gen) < 0.5, -1.0, 1.0)
    return (pool * signs)[torch.randperm(pool.numel(), generator=gen)]


@pytest.mark.parametrize("dtype", [FP8, INT8], ids=["fp8", "int8"])
def test_8bit_stores_round_exactly_as_torch(products, dtype):
    """With RoPE the identity (cos 1, sin 0) and each entry's largest value at the code's top (scale
    1), the stored codes are torch's casts of the values themselves: every code, every tie between two
    (to even), subnormals, signs."""
    gen = torch.Generator().manual_seed(21)
    kv_heads, head_dim, block_size = 2, 64, 16
    cases = rounding_cases(dtype, gen, 2000)
    per_entry = head_dim - 1
    entries = -(-cases.numel() // (2 * kv_heads * per_entry))  # tokens, each of K and V for every head
    cases = torch.cat([cases, torch.zeros(entries * 2 * kv_heads * per_entry - cases.numel())])
    kv = torch.cat([torch.full((entries, 2 * kv_heads, 1), CODE_TOP[dtype]), cases.view(entries, 2 * kv_heads, per_entry)],
                   dim=-1)
    q_heads = 2
    qkv = torch.cat([torch.randn(entries, q_heads * head_dim, generator=gen), kv.reshape(entries, -1)], dim=1)
    cos, sin = torch.ones(entries, head_dim), torch.zeros(entries, head_dim)
    (k_codes, v_codes), (k_scales, v_scales) = coded_caches(-(-entries // block_size), block_size, kv_heads,
                                                            head_dim, dtype)
    slots = torch.arange(entries)
    products.rope_store(qkv, cos, sin, k_codes, v_codes, slots, None, None, k_scales=k_scales, v_scales=v_scales)
    stored = torch.cat([k_codes.view(-1, kv_heads, head_dim)[:entries], v_codes.view(-1, kv_heads, head_dim)[:entries]],
                       dim=1)
    expected = kv.clamp(-CODE_TOP[dtype], CODE_TOP[dtype])
    expected = (expected if dtype == FP8 else expected.round()).to(dtype)
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert bool((k_scales.reshape(-1, kv_heads)[:entries] == 1.0).all())  # each entry's largest on the top


@pytest.mark.parametrize("dtype,rotate", [(FP8, False), (INT8, True), (INT8, False)], ids=["fp8", "int8-rotated", "int8"])
def test_8bit_rope_and_store_write_the_references_codes(products, dtype, rotate):
    """Real-valued rows: q as the reference gives it (rotated by the Hadamard matrix for the int8
    cache, as the engine runs it), and the codes and scales of K and V the reference writes, but for
    values that the two round on either side of a code's midpoint (at most one code apart)."""
    gen = torch.Generator().manual_seed(22 + rotate)
    tokens, q_heads, kv_heads, head_dim, block_size = 40, 6, 2, 64, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    table = torch.stack((torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)), dim=1)
    slots = torch.randperm(4 * block_size, generator=gen)[:tokens]
    slots[3] = -1  # skipped
    codes, scales = [], []
    for _ in range(2):
        c, s = coded_caches(4, block_size, kv_heads, head_dim, dtype)
        codes.append(c)
        scales.append(s)
    want = qk_norm_rope_store(qkv, table[:, 0], table[:, 1], None, None, 0.0, *codes[0], slots, None, None,
                              k_scales=scales[0][0], v_scales=scales[0][1], hadamard_qk=rotate)
    got = products.rope_store(qkv, table[:, 0], table[:, 1], *codes[1], slots, None, None,
                              k_scales=scales[1][0], v_scales=scales[1][1], hadamard_qk=rotate)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    for side in (0, 1):
        assert torch.allclose(scales[1][side], scales[0][side], rtol=1e-5, atol=0)
        mine, theirs = codes[1][side].float(), codes[0][side].float()
        differ = mine != theirs
        assert float(differ.float().mean()) < 0.01
        if dtype == INT8:
            assert float((mine - theirs).abs().max()) <= 1
        else:  # neighbouring e4m3 codes: their bytes, as integers, one apart
            assert int((codes[1][side].view(torch.uint8).int() - codes[0][side].view(torch.uint8).int()).abs().max()) <= 1
    written = codes[1][0].view(torch.uint8).view(-1, kv_heads * head_dim).any(dim=1).nonzero().flatten()
    assert written.tolist() == sorted(slots[slots >= 0].tolist())  # every slot but the skipped one's


@pytest.mark.parametrize("dtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("head_dim,lengths", [(64, [1, 200, 37, 16]), (128, [37, 100]), (80, [50, 3])])
def test_decode_attention_over_codes_matches_the_reference(products, dtype, head_dim, lengths):
    gen = torch.Generator().manual_seed(head_dim + len(lengths))
    k_values, v_values, tables, context = paged_context(lengths, gen, kv_heads=2, head_dim=head_dim)
    if len(lengths) == 4:
        tables[2, 1] = -1  # a hole: skipped
    caches = {}
    for name, values in (("k", k_values), ("v", v_values)):
        codes, scales = quantize_rows(values, dtype)
        caches[f"{name}_cache"] = codes
        caches[f"{name}_scales"] = scales.transpose(1, 2).contiguous().transpose(1, 2)  # the engine's layout
    query = torch.randn(len(lengths), 6, head_dim, generator=gen)
    want = paged_decode_attention(query, block_tables=tables, context_lens=context, scale=head_dim ** -0.5, **caches)
    got = products.decode_attention(query, block_tables=tables, context_lens=context, scale=head_dim ** -0.5,
                                    threads=2, **caches)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    alone = products.decode_attention(query[-1:], block_tables=tables[-1:], context_lens=context[-1:],
                                      scale=head_dim ** -0.5, threads=1, **caches)
    assert torch.equal(alone, got[-1:])  # a sequence's answer is the same bits alone as in its batch


@pytest.mark.parametrize("dtype", [FP8, INT8], ids=["fp8", "int8"])
def test_decode_attention_reads_every_code_exactly(products, dtype):
    """Contexts of one entry: the output is that entry's values, so every code (e4m3's subnormals
    included; not its NaN) times its scale must come out bit for bit as the reference dequantizes it."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).view(4, 1, 1, 64)
    if dtype == FP8:
        codes = torch.where(codes.float().isnan(), torch.zeros((), dtype=FP8), codes)
    scales = torch.tensor([0.5, 3.0e-3, 7.25, 1.0]).view(4, 1, 1)  # one block of one entry each
    tables, context = torch.arange(4, dtype=torch.int32).view(4, 1), torch.ones(4, dtype=torch.int32)
    query = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(24))
    got = products.decode_attention(query, codes, codes, tables, context, 0.125, threads=1, k_scales=scales,
                                    v_scales=scales)
    values = codes.float() * scales[..., None]
    assert torch.equal(got, values.view(4, 1, 64).expand(4, 2, 64))


def test_8bit_caches_are_refused_without_their_scales_or_in_another_layout(products):
    gen = torch.Generator().manual_seed(23)
    k_values, v_values, tables, context = paged_context([20], gen, kv_heads=2)
    (k_codes, k_scales), (v_codes, v_scales) = quantize_rows(k_values, FP8), quantize_rows(v_values, FP8)
    query = torch.randn(1, 4, 64, generator=gen)
    args = dict(query=query, block_tables=tables, context_lens=context, scale=0.125, threads=1)
    with pytest.raises(ValueError, match="needs scales exactly when it holds 8-bit codes"):
        products.decode_attention(k_cache=k_codes, v_cache=v_codes, **args)
    with pytest.raises(ValueError, match=r"laid out \[blocks, kv_heads, block_size\]"):
        products.decode_attention(k_cache=k_codes, v_cache=v_codes, k_scales=k_scales, v_scales=v_scales, **args)
    with pytest.raises(ValueError, match="float32 or 8-bit codes"):
        products.decode_attention(k_cache=k_values.bfloat16(), v_cache=v_values.bfloat16(), **args)
    with pytest.raises(ValueError, match="needs scales exactly"):
        products.decode_attention(k_cache=k_values, v_cache=v_values, k_scales=k_scales, v_scales=v_scales, **args)
