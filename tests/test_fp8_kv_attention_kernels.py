"""The Triton attention and window-score kernels reading an 8-bit KV cache (float8_e4m3fn or int8
codes with per-entry float32 scales; every test runs for both, CODE_DTYPES), run on the CPU with the
Triton interpreter (TRITON_INTERPRET=1), against the PyTorch reference on the very same codes (filled
by the reference store_kv), and against attention over the unquantized K/V. Queries are float32 as in
test_triton_kernels.py (the interpreter's bf16 tl.dot is wrong); one case runs fp16 queries (codes
converted to fp16, exactly for both: every e4m3 value and every int8 is an fp16 value)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from zipage.kernels import reference as ref  # noqa: E402
from zipage.kernels import triton_ops  # noqa: E402

triton_ops.patch_interpreter_for_numpy2()

from zipage.kernels import triton_attention as tatt  # noqa: E402
from zipage.kernels import triton_scores as tscores  # noqa: E402
from zipage.testing import random_paged_cache  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5  # as the fp32 tests of test_triton_kernels.py
KV_HEADS = 2
FP8, INT8 = torch.float8_e4m3fn, torch.int8
CODE_DTYPES = [FP8, INT8]  # the 8-bit caches' codes (kernels.reference.CODE_MAX)
by_code = pytest.mark.parametrize("codes_dtype", CODE_DTYPES, ids=["fp8", "int8"])


def close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def relative_error(actual, expected):
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def quantized_paged_cache(lens, block_size, head_dim, gen, codes_dtype, **layout):
    """Random K/V values in shuffled paged caches (random_paged_cache) and the same values stored by
    the reference store_kv into an 8-bit cache of codes_dtype. Entries get magnitudes spread over
    about two orders (so every entry's own scale matters); slots outside every context hold values
    100x louder, so a kernel reading one shows. The random draws do not depend on codes_dtype: one
    seed gives the same values for both. Returns (k_values, v_values, dict of cache args, tables)."""
    k_values, v_values, tables = random_paged_cache(lens, block_size, KV_HEADS, head_dim, gen, **layout)
    num_blocks = k_values.shape[0]
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, n in zip(tables.long(), lens):
        blocks = row[:-(-n // block_size)]
        used[(blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]] = True
    loud = torch.where(used, 1.0, 100.0).view(num_blocks, block_size, 1, 1)
    spread = lambda: torch.exp(torch.randn(num_blocks, block_size, KV_HEADS, 1, generator=gen))  # noqa: E731
    k_values, v_values = k_values * spread() * loud, v_values * spread() * loud
    k_cache = torch.empty(k_values.shape, dtype=codes_dtype)
    v_cache = torch.empty(v_values.shape, dtype=codes_dtype)
    # the engine's layout: each head's scales of a block contiguous (a transposed view)
    k_scales = torch.empty(num_blocks, KV_HEADS, block_size).transpose(1, 2)
    v_scales = torch.empty(num_blocks, KV_HEADS, block_size).transpose(1, 2)
    ref.store_kv(k_values.view(-1, KV_HEADS, head_dim), v_values.view(-1, KV_HEADS, head_dim), k_cache, v_cache,
                 torch.arange(num_blocks * block_size), k_scales=k_scales, v_scales=v_scales)
    assert k_scales.std() > 0 and v_scales.std() > 0
    if codes_dtype == INT8:  # symmetric codes, every row's amax on 127
        assert int(k_cache.min()) == -127 and int(v_cache.max()) == 127
    cache = dict(k_cache=k_cache, v_cache=v_cache, k_scales=k_scales, v_scales=v_scales)
    return k_values, v_values, cache, tables


def decode_inputs(group, head_dim, block_size, seed, codes_dtype, lens=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lens = lens or ([1, 300, 77] if block_size == 16 else [5, 290, 257])  # not multiples of the block
    k_values, v_values, cache, tables = quantized_paged_cache(lens, block_size, head_dim, gen, codes_dtype,
                                                              ahead=([1, 0, 1] * len(lens))[:len(lens)])
    query = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = dict(query=query, block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32),
                scale=head_dim ** -0.5)
    return args, cache, (k_values, v_values)


def prefill_inputs(group, head_dim, block_size, seed, codes_dtype, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # (new queries, KV entries after the chunk): plain prompt, cached prefix, one token, empty.
    shapes = [(37, 37), (20, 150), (1, 77), (0, 16), (70, 90)]
    lens = [n for _, n in shapes]
    k_values, v_values, cache, tables = quantized_paged_cache(lens, block_size, head_dim, gen, codes_dtype,
                                                              ahead=[0, 1, 0, 0, 1])
    cu = torch.tensor([0] + torch.tensor([q for q, _ in shapes]).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = dict(query=query, block_tables=tables, cu_seqlens_q=cu,
                context_lens=torch.tensor(lens, dtype=torch.int32), scale=head_dim ** -0.5)
    return args, cache, (k_values, v_values)


def window_inputs(group, head_dim, block_size, window, kv_len, seed, codes_dtype):
    gen = torch.Generator().manual_seed(seed)
    k_values, _, cache, tables = quantized_paged_cache([kv_len], block_size, head_dim, gen, codes_dtype)
    table = tables[0][tables[0] >= 0].long()  # the compressor passes an int64 1-D table
    queries = torch.randn(window, KV_HEADS * group, head_dim, generator=gen)
    args = dict(window_queries=queries, k_cache=cache["k_cache"], block_table=table, kv_len=kv_len,
                scale=head_dim ** -0.5, k_scales=cache["k_scales"])
    return args, k_values


# ---------------------------------------------------------------------------------------------
# Decode attention


@by_code
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (4, 128, 16), (8, 64, 16), (4, 16, 16),
                                                       (2, 64, 256), (2, 80, 256)])
def test_8bit_decode_attention(group, head_dim, block_size, codes_dtype):
    args, cache, _ = decode_inputs(group, head_dim, block_size, seed=group * 1000 + head_dim + block_size,
                                   codes_dtype=codes_dtype)
    expected = ref.paged_decode_attention(**args, **cache)
    out = tatt.paged_decode_attention(**args, **cache)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    close(out, expected)


@by_code
@pytest.mark.parametrize("block_size,ways,min_partition,block_n", [(16, 5, 16, 16), (16, 3, 64, 64),
                                                                   (256, 6, 64, 64)])
def test_8bit_decode_split_k(block_size, ways, min_partition, block_n, codes_dtype):
    """Several partitions per sequence (some past a short context) and the reduce, on an 8-bit cache."""
    lens = [300, 3, 150, 64] if block_size == 16 else [300, 40]
    args, cache, _ = decode_inputs(4, 64, block_size, seed=ways + min_partition, codes_dtype=codes_dtype, lens=lens)
    expected = ref.paged_decode_attention(**args, **cache)
    split = tatt.paged_decode_attention_impl(**args, **cache, num_partitions=ways, min_partition=min_partition,
                                             block_n=block_n)
    close(split, expected)
    close(split, tatt.paged_decode_attention_impl(**args, **cache, num_partitions=1))


@by_code
def test_8bit_decode_bulk_copied_whole_tiles(codes_dtype):
    """Whole tiles of codes by bulk copy (DecodeLaunch.tma; the interpreter emulates the copies),
    with table entries loaded a tile or held ahead: the same as each thread's loads, with part
    tiles and split partitions around them."""
    args, cache, _ = decode_inputs(2, 64, 256, seed=31, codes_dtype=codes_dtype, lens=[256, 300, 255, 3])
    assert tatt._tma_ok(cache["k_cache"], 64, 64) and tatt._tma_ok(cache["v_cache"], 64, 64)
    expected = ref.paged_decode_attention(**args, **cache)
    for ways, ahead in ((1, 0), (3, 0), (3, 2)):
        launch = tatt.DecodeLaunch(4, tma=True, table_ahead=ahead)
        bulk = tatt.paged_decode_attention_impl(**args, **cache, num_partitions=ways, min_partition=64, launch=launch)
        close(bulk, expected)
        loads = tatt.paged_decode_attention_impl(**args, **cache, num_partitions=ways, min_partition=64,
                                                 launch=tatt.DecodeLaunch(4))
        close(bulk, loads, rtol=1e-5, atol=1e-6)


FP16_ERROR = 2e-3  # relative norm: each side rounds to fp16 in its own places (each ~3e-4 from fp32)


@by_code
def test_8bit_decode_fp16_queries(codes_dtype):
    """fp16 queries: codes converted to fp16 for the products (the interpreter's fp16 tl.dot is
    right, unlike its bf16 one)."""
    args, cache, _ = decode_inputs(4, 64, 16, seed=5, codes_dtype=codes_dtype, dtype=torch.float16)
    out = tatt.paged_decode_attention(**args, **cache)
    assert out.dtype == torch.float16
    assert relative_error(out, ref.paged_decode_attention(**args, **cache)) < FP16_ERROR


@pytest.mark.parametrize("value_size", [1e-3, 1.0, 1e3])
def test_fp8_decode_fp16_products_keep_small_and_large_values(value_size):
    """An fp8 cache meets fp16 queries in fp16 products (DECODE_LAUNCH), in whole tiles (block 256)
    and a part tile. Values of any magnitude a model stores come out within fp16's rounding: the
    probabilities are weighed by scale x FP16_VALUE_WEIGHT, so rows of 1e-3 do not sink into fp16
    subnormals and rows of 1e3 do not overflow."""
    args, cache, _ = decode_inputs(2, 64, 256, seed=9, codes_dtype=torch.float8_e4m3fn, dtype=torch.float16,
                                   lens=[290, 257, 64])
    cache = dict(cache, v_scales=cache["v_scales"] * value_size)
    assert tatt.decode_launch(torch.float8_e4m3fn).fp16_products
    out = tatt.paged_decode_attention(**args, **cache)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    exact = ref.paged_decode_attention(**dict(args, query=args["query"].float()), **cache)  # (fp16 would overflow)
    assert relative_error(out, exact) < FP16_ERROR


# ---------------------------------------------------------------------------------------------
# Prefill attention


@by_code
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (2, 128, 16), (4, 64, 16), (2, 64, 256)])
def test_8bit_prefill_attention(group, head_dim, block_size, codes_dtype):
    args, cache, _ = prefill_inputs(group, head_dim, block_size, seed=7 * group + head_dim + block_size,
                                    codes_dtype=codes_dtype)
    expected = ref.prefill_attention(**args, **cache)
    close(tatt.prefill_attention(**args, **cache), expected)
    if group == 2 and block_size == 16:  # several query tiles per sequence
        close(tatt.prefill_attention_impl(**args, **cache, block_m=16, block_n=32), expected)


LAUNCH_SHAPES = [(True, False, 32, 16), (False, True, 16, 8), (True, True, 16, 8)]


@pytest.mark.parametrize("tma,heads_fast,block_m,block_n,codes_dtype",
                         [(*shape, FP8) for shape in LAUNCH_SHAPES] + [(*LAUNCH_SHAPES[0], INT8)],
                         ids=["fp8-tma", "fp8-heads_fast", "fp8-tma-heads_fast", "int8-tma"])
def test_8bit_prefill_launch_shapes(tma, heads_fast, block_m, block_n, codes_dtype):
    """The GPU's launch shapes on an 8-bit cache, the bulk-copied (TMA, 1-byte rows) full tiles
    included. int8 runs the bulk-copy shape alone (its 1-byte rows are the new descriptor dtype; the
    16x8 shapes take 8-9 s each under the interpreter and exercise no code-dtype path)."""
    args, cache, _ = prefill_inputs(2, 32, 16, seed=block_m + block_n + 2 * tma + heads_fast, codes_dtype=codes_dtype)
    tiles = tatt.PrefillTiles(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, tma=tma,
                              heads_fast=heads_fast)
    assert not tma or tatt._tma_ok(cache["k_cache"], 32, 32)  # the bulk-copy path is taken
    close(tatt.prefill_attention_impl(**args, **cache, tiles=tiles), ref.prefill_attention(**args, **cache))


def test_8bit_prefill_tiles_on_hopper(monkeypatch):
    """On sm_90 an 8-bit cache (fp8 or int8: both 1-byte codes) keeps the bulk copies but, at head
    size 128, 64-key tiles (128 spill: the codes are converted in registers); a bf16 cache keeps its
    shapes."""
    monkeypatch.setattr(tatt, "_hopper", lambda device: True)
    cpu = torch.device("cpu")
    assert {dtype.itemsize for dtype in CODE_DTYPES} == {1}
    assert tatt.prefill_tiles(512, 128, cpu, itemsize=1) == tatt.PrefillTiles(128, 64, 8, 3, tma=True)
    assert tatt.prefill_tiles(512, 128, cpu, itemsize=2) == tatt.PrefillTiles(128, 128, 8, 3, tma=True)
    assert tatt.prefill_tiles(512, 64, cpu, itemsize=1) == tatt.prefill_tiles(512, 64, cpu, itemsize=2)


@by_code
def test_8bit_prefill_fp16_queries(codes_dtype):
    args, cache, _ = prefill_inputs(2, 64, 16, seed=11, codes_dtype=codes_dtype, dtype=torch.float16)
    out = tatt.prefill_attention(**args, **cache)
    assert out.dtype == torch.float16
    assert relative_error(out, ref.prefill_attention(**args, **cache)) < FP16_ERROR


# ---------------------------------------------------------------------------------------------
# Window attention score


@by_code
@pytest.mark.parametrize("group,head_dim,block_size,window,kv_len", [
    (1, 64, 16, 16, 100), (4, 64, 16, 8, 600), (2, 128, 256, 16, 300), (8, 16, 16, 4, 61)])
def test_8bit_window_attention_score(group, head_dim, block_size, window, kv_len, codes_dtype):
    args, _ = window_inputs(group, head_dim, block_size, window, kv_len, seed=group + head_dim + window + kv_len,
                            codes_dtype=codes_dtype)
    expected = ref.window_attention_score(**args)
    out = tscores.window_attention_score(**args)
    assert out.dtype == torch.float32 and out.shape == (KV_HEADS, kv_len)
    close(out, expected)


# ---------------------------------------------------------------------------------------------
# Against the unquantized values, and the contract


# relative norm; fp8 rounding gives ~0.04 (the loudest keys' logits move most), int8's finer step ~4x less
UNQUANTIZED_ERROR = {FP8: 0.1, INT8: 0.025}


def test_8bit_close_to_unquantized_attention():
    """Each scale applied once: the results on either cache are within its rounding of the results
    over the values the cache was filled from (a scale missing or applied twice is off by ~100x);
    and on the same values int8's results are the closer ones (its step amax / 127 is finer than
    e4m3's 3 mantissa bits on these rows, which hold no outliers)."""
    errors = {}
    for dtype in CODE_DTYPES:
        args, codes, (k_values, v_values) = decode_inputs(4, 64, 16, seed=3, codes_dtype=dtype)
        exact = ref.paged_decode_attention(**args, k_cache=k_values, v_cache=v_values)
        decode = relative_error(tatt.paged_decode_attention(**args, **codes), exact)

        args, codes, (k_values, v_values) = prefill_inputs(2, 64, 16, seed=4, codes_dtype=dtype)
        exact = ref.prefill_attention(**args, k_cache=k_values, v_cache=v_values)
        prefill = relative_error(tatt.prefill_attention(**args, **codes), exact)

        args, k_values = window_inputs(2, 64, 16, 8, 200, seed=6, codes_dtype=dtype)
        exact = ref.window_attention_score(**{**args, "k_cache": k_values, "k_scales": None})
        window = relative_error(tscores.window_attention_score(**args), exact)
        errors[dtype] = (decode, prefill, window)
        assert max(errors[dtype]) < UNQUANTIZED_ERROR[dtype], (dtype, errors[dtype])
    for fp8_error, int8_error in zip(errors[FP8], errors[INT8]):
        assert int8_error < fp8_error / 2, errors


@by_code
def test_8bit_cache_needs_its_scales(codes_dtype):
    args, cache, (k_values, v_values) = decode_inputs(1, 64, 16, seed=8, codes_dtype=codes_dtype)
    with pytest.raises(ValueError):  # 8-bit codes without scales
        tatt.paged_decode_attention(**args, k_cache=cache["k_cache"], v_cache=cache["v_cache"])
    with pytest.raises(ValueError):  # scales beside a float32 cache
        tatt.paged_decode_attention(**args, k_cache=k_values, v_cache=v_values, k_scales=cache["k_scales"],
                                    v_scales=cache["v_scales"])
