"""The Triton attention and window-score kernels reading an fp8 KV cache (float8_e4m3fn codes with
per-entry float32 scales), run on the CPU with the Triton interpreter (TRITON_INTERPRET=1), against
the PyTorch reference on the very same fp8 cache (filled by the reference store_kv), and against
attention over the unquantized K/V. Queries are float32 as in test_triton_kernels.py (the
interpreter's bf16 tl.dot is wrong); one case runs fp16 queries (codes converted to fp16)."""

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
FP8 = torch.float8_e4m3fn


def close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def relative_error(actual, expected):
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def fp8_paged_cache(lens, block_size, head_dim, gen, **layout):
    """Random K/V values in shuffled paged caches (random_paged_cache) and the same values stored by
    the reference store_kv into an fp8 cache. Entries get magnitudes spread over about two orders
    (so every entry's own scale matters); slots outside every context hold values 100x louder, so
    a kernel reading one shows. Returns (k_values, v_values, fp8 dict of cache args, tables)."""
    k_values, v_values, tables = random_paged_cache(lens, block_size, KV_HEADS, head_dim, gen, **layout)
    num_blocks = k_values.shape[0]
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, n in zip(tables.long(), lens):
        blocks = row[:-(-n // block_size)]
        used[(blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]] = True
    loud = torch.where(used, 1.0, 100.0).view(num_blocks, block_size, 1, 1)
    spread = lambda: torch.exp(torch.randn(num_blocks, block_size, KV_HEADS, 1, generator=gen))  # noqa: E731
    k_values, v_values = k_values * spread() * loud, v_values * spread() * loud
    k_cache = torch.empty(k_values.shape, dtype=FP8)
    v_cache = torch.empty(v_values.shape, dtype=FP8)
    # the engine's layout: each head's scales of a block contiguous (a transposed view)
    k_scales = torch.empty(num_blocks, KV_HEADS, block_size).transpose(1, 2)
    v_scales = torch.empty(num_blocks, KV_HEADS, block_size).transpose(1, 2)
    ref.store_kv(k_values.view(-1, KV_HEADS, head_dim), v_values.view(-1, KV_HEADS, head_dim), k_cache, v_cache,
                 torch.arange(num_blocks * block_size), k_scales=k_scales, v_scales=v_scales)
    assert k_scales.std() > 0 and v_scales.std() > 0
    fp8 = dict(k_cache=k_cache, v_cache=v_cache, k_scales=k_scales, v_scales=v_scales)
    return k_values, v_values, fp8, tables


def decode_inputs(group, head_dim, block_size, seed, lens=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lens = lens or ([1, 300, 77] if block_size == 16 else [5, 290, 257])  # not multiples of the block
    k_values, v_values, fp8, tables = fp8_paged_cache(lens, block_size, head_dim, gen, ahead=[1, 0, 1][:len(lens)])
    query = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = dict(query=query, block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32),
                scale=head_dim ** -0.5)
    return args, fp8, (k_values, v_values)


def prefill_inputs(group, head_dim, block_size, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # (new queries, KV entries after the chunk): plain prompt, cached prefix, one token, empty.
    shapes = [(37, 37), (20, 150), (1, 77), (0, 16), (70, 90)]
    lens = [n for _, n in shapes]
    k_values, v_values, fp8, tables = fp8_paged_cache(lens, block_size, head_dim, gen, ahead=[0, 1, 0, 0, 1])
    cu = torch.tensor([0] + torch.tensor([q for q, _ in shapes]).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = dict(query=query, block_tables=tables, cu_seqlens_q=cu,
                context_lens=torch.tensor(lens, dtype=torch.int32), scale=head_dim ** -0.5)
    return args, fp8, (k_values, v_values)


def window_inputs(group, head_dim, block_size, window, kv_len, seed):
    gen = torch.Generator().manual_seed(seed)
    k_values, _, fp8, tables = fp8_paged_cache([kv_len], block_size, head_dim, gen)
    table = tables[0][tables[0] >= 0].long()  # the compressor passes an int64 1-D table
    queries = torch.randn(window, KV_HEADS * group, head_dim, generator=gen)
    args = dict(window_queries=queries, k_cache=fp8["k_cache"], block_table=table, kv_len=kv_len,
                scale=head_dim ** -0.5, k_scales=fp8["k_scales"])
    return args, k_values


# ---------------------------------------------------------------------------------------------
# Decode attention


@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (4, 128, 16), (8, 64, 16), (4, 16, 16),
                                                       (2, 64, 256)])
def test_fp8_decode_attention(group, head_dim, block_size):
    args, fp8, _ = decode_inputs(group, head_dim, block_size, seed=group * 1000 + head_dim + block_size)
    expected = ref.paged_decode_attention(**args, **fp8)
    out = tatt.paged_decode_attention(**args, **fp8)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    close(out, expected)


@pytest.mark.parametrize("block_size,ways,min_partition,block_n", [(16, 5, 16, 16), (16, 3, 64, 64),
                                                                   (256, 6, 64, 64)])
def test_fp8_decode_split_k(block_size, ways, min_partition, block_n):
    """Several partitions per sequence (some past a short context) and the reduce, on an fp8 cache."""
    lens = [300, 3, 150, 64] if block_size == 16 else [300, 40]
    args, fp8, _ = decode_inputs(4, 64, block_size, seed=ways + min_partition, lens=lens)
    expected = ref.paged_decode_attention(**args, **fp8)
    split = tatt.paged_decode_attention_impl(**args, **fp8, num_partitions=ways, min_partition=min_partition,
                                             block_n=block_n)
    close(split, expected)
    close(split, tatt.paged_decode_attention_impl(**args, **fp8, num_partitions=1))


FP16_ERROR = 2e-3  # relative norm: each side rounds to fp16 in its own places (each ~3e-4 from fp32)


def test_fp8_decode_fp16_queries():
    """fp16 queries: codes converted to fp16 for the products (the interpreter's fp16 tl.dot is
    right, unlike its bf16 one)."""
    args, fp8, _ = decode_inputs(4, 64, 16, seed=5, dtype=torch.float16)
    out = tatt.paged_decode_attention(**args, **fp8)
    assert out.dtype == torch.float16
    assert relative_error(out, ref.paged_decode_attention(**args, **fp8)) < FP16_ERROR


# ---------------------------------------------------------------------------------------------
# Prefill attention


@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (2, 128, 16), (4, 64, 16), (2, 64, 256)])
def test_fp8_prefill_attention(group, head_dim, block_size):
    args, fp8, _ = prefill_inputs(group, head_dim, block_size, seed=7 * group + head_dim + block_size)
    expected = ref.prefill_attention(**args, **fp8)
    close(tatt.prefill_attention(**args, **fp8), expected)
    if group == 2 and block_size == 16:  # several query tiles per sequence
        close(tatt.prefill_attention_impl(**args, **fp8, block_m=16, block_n=32), expected)


@pytest.mark.parametrize("tma,heads_fast,block_m,block_n", [(True, False, 32, 16), (False, True, 16, 8),
                                                            (True, True, 16, 8)])
def test_fp8_prefill_launch_shapes(tma, heads_fast, block_m, block_n):
    """The GPU's launch shapes on an fp8 cache, the bulk-copied (TMA, 1-byte rows) full tiles included."""
    args, fp8, _ = prefill_inputs(2, 32, 16, seed=block_m + block_n + 2 * tma + heads_fast)
    tiles = tatt.PrefillTiles(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, tma=tma,
                              heads_fast=heads_fast)
    assert not tma or tatt._tma_ok(tiles, fp8["k_cache"], 32, 32, 16)  # the bulk-copy path is taken
    close(tatt.prefill_attention_impl(**args, **fp8, tiles=tiles), ref.prefill_attention(**args, **fp8))


def test_fp8_prefill_tiles_on_hopper(monkeypatch):
    """On sm_90 an fp8 cache keeps the bulk copies but, at head size 128, 64-key tiles (128 spill:
    the codes are converted in registers); a bf16 cache keeps its shapes."""
    monkeypatch.setattr(tatt, "_hopper", lambda device: True)
    cpu = torch.device("cpu")
    assert tatt.prefill_tiles(512, 128, cpu, itemsize=1) == tatt.PrefillTiles(128, 64, 8, 3, tma=True)
    assert tatt.prefill_tiles(512, 128, cpu, itemsize=2) == tatt.PrefillTiles(128, 128, 8, 3, tma=True)
    assert tatt.prefill_tiles(512, 64, cpu, itemsize=1) == tatt.prefill_tiles(512, 64, cpu, itemsize=2)


def test_fp8_prefill_fp16_queries():
    args, fp8, _ = prefill_inputs(2, 64, 16, seed=11, dtype=torch.float16)
    out = tatt.prefill_attention(**args, **fp8)
    assert out.dtype == torch.float16
    assert relative_error(out, ref.prefill_attention(**args, **fp8)) < FP16_ERROR


# ---------------------------------------------------------------------------------------------
# Window attention score


@pytest.mark.parametrize("group,head_dim,block_size,window,kv_len", [
    (1, 64, 16, 16, 100), (4, 64, 16, 8, 600), (2, 128, 256, 16, 300), (8, 16, 16, 4, 61)])
def test_fp8_window_attention_score(group, head_dim, block_size, window, kv_len):
    args, _ = window_inputs(group, head_dim, block_size, window, kv_len, seed=group + head_dim + window + kv_len)
    expected = ref.window_attention_score(**args)
    out = tscores.window_attention_score(**args)
    assert out.dtype == torch.float32 and out.shape == (KV_HEADS, kv_len)
    close(out, expected)


# ---------------------------------------------------------------------------------------------
# Against the unquantized values, and the contract


UNQUANTIZED_ERROR = 0.1  # relative norm; fp8 rounding gives ~0.04 (the loudest keys' logits move most)


def test_fp8_close_to_unquantized_attention():
    """Each scale applied once: the fp8 results are within fp8's rounding of the results over the
    values the cache was filled from (a scale missing or applied twice is off by ~100x)."""
    args, fp8, (k_values, v_values) = decode_inputs(4, 64, 16, seed=3)
    exact = ref.paged_decode_attention(**args, k_cache=k_values, v_cache=v_values)
    assert relative_error(tatt.paged_decode_attention(**args, **fp8), exact) < UNQUANTIZED_ERROR

    args, fp8, (k_values, v_values) = prefill_inputs(2, 64, 16, seed=4)
    exact = ref.prefill_attention(**args, k_cache=k_values, v_cache=v_values)
    assert relative_error(tatt.prefill_attention(**args, **fp8), exact) < UNQUANTIZED_ERROR

    args, k_values = window_inputs(2, 64, 16, 8, 200, seed=6)
    exact = ref.window_attention_score(**{**args, "k_cache": k_values, "k_scales": None})
    assert relative_error(tscores.window_attention_score(**args), exact) < UNQUANTIZED_ERROR


def test_fp8_cache_needs_its_scales():
    args, fp8, (k_values, v_values) = decode_inputs(1, 64, 16, seed=8)
    with pytest.raises(ValueError):  # fp8 codes without scales
        tatt.paged_decode_attention(**args, k_cache=fp8["k_cache"], v_cache=fp8["v_cache"])
    with pytest.raises(ValueError):  # scales beside a float32 cache
        tatt.paged_decode_attention(**args, k_cache=k_values, v_cache=v_values, k_scales=fp8["k_scales"],
                                    v_scales=fp8["v_scales"])
