"""Every Triton kernel against its PyTorch reference (kernels.reference), run on the CPU with the
Triton interpreter (TRITON_INTERPRET=1): ragged lengths, -1 padding, shuffled block tables, GQA
ratios 1/2/4/8, head dims 16/64/128, block sizes 16 and 256. Inputs are float32 (the interpreter
emulates bf16 poorly); the bf16 checks at real sizes run on the GPU (benchmarks/gpu_check.py).
Shapes stay tiny: the interpreter executes every program instance in Python."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from zipage import kernels  # noqa: E402
from zipage.kernels import reference as ref  # noqa: E402
from zipage.kernels import triton_ops  # noqa: E402

triton_ops.patch_interpreter_for_numpy2()

from zipage.kernels import triton_attention as tatt  # noqa: E402
from zipage.kernels import triton_cache as tcache  # noqa: E402
from zipage.kernels import triton_scores as tscores  # noqa: E402
from zipage.testing import random_paged_cache  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
KV_HEADS = 2


def close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def paged_cache(lens, block_size, kv_heads, head_dim, gen, spare_blocks=3, extra_cols=2, ahead=None):
    return random_paged_cache(lens, block_size, kv_heads, head_dim, gen, spare_blocks=spare_blocks,
                              extra_cols=extra_cols, ahead=ahead)


# ---------------------------------------------------------------------------------------------
# Registration


def test_triton_ops_registers_nothing_without_cuda():
    assert set(triton_ops.IMPLS) == set(triton_ops.NAMES)
    if not torch.cuda.is_available():
        assert triton_ops.REGISTERED == []
        assert not kernels.TRITON_IMPLS
    for name in triton_ops.NAMES:  # same signature as the reference
        import inspect
        assert (inspect.signature(triton_ops.IMPLS[name]).parameters.keys()
                == inspect.signature(getattr(ref, name)).parameters.keys()), name


# ---------------------------------------------------------------------------------------------
# Cache writes


@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kv(block_size):
    gen = torch.Generator().manual_seed(1)
    head_dim, tokens = 64, 21
    num_blocks = 4
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7, 20]] = -1
    qkv = torch.randn(tokens, 3 * KV_HEADS * head_dim, generator=gen)  # value is a strided view
    key = qkv[:, :KV_HEADS * head_dim].reshape(tokens, KV_HEADS, head_dim).contiguous()
    value = qkv[:, 2 * KV_HEADS * head_dim:].view(tokens, KV_HEADS, head_dim)
    assert not value.is_contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, k_ref, v_ref, slots)
    tcache.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_queries():
    gen = torch.Generator().manual_seed(2)
    rows, q_heads, head_dim, tokens = 24, 8, 64, 10
    cache = torch.randn(3, rows, q_heads, head_dim, generator=gen)[1]  # one layer of a larger cache
    query = torch.randn(tokens, q_heads, head_dim, generator=gen)
    slots = torch.tensor([-1, 5, 6, -1, 23, 0, -1, -1, 11, 12])
    expected = cache.clone()
    ref.store_queries(query, expected, slots)
    tcache.store_queries(query, cache, slots)
    assert torch.equal(cache, expected)
    tcache.store_queries(query, cache, torch.full((tokens,), -1))  # all skipped
    assert torch.equal(cache, expected)


# ---------------------------------------------------------------------------------------------
# Decode attention

DECODE_CASES = [  # (group, head_dim, block_size); 80: a head narrower than its padded tile
    (1, 64, 16), (2, 128, 16), (4, 64, 16), (8, 128, 16), (4, 16, 16), (2, 8, 16), (4, 128, 256), (1, 64, 256),
    (2, 80, 256), (2, 80, 16),
]


@pytest.mark.parametrize("group,head_dim,block_size", DECODE_CASES)
def test_paged_decode_attention(group, head_dim, block_size):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    lens = [1, 300, 77] if block_size == 16 else [5, 290, 257]
    k_cache, v_cache, tables = paged_cache(lens, block_size, KV_HEADS, head_dim, gen, ahead=[1, 0, 1])
    query = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    expected = ref.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    out = tatt.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    close(out, expected)


@pytest.mark.parametrize("block_size,ways,min_partition,block_n", [
    (16, 5, 16, 16), (16, 4, 64, 64), (16, 7, 32, 32), (16, 3, 256, 64), (256, 6, 64, 64)])
def test_decode_split_k_equals_unsplit(block_size, ways, min_partition, block_n):
    """Forcing several partitions per sequence (some past a short context, some sequences fitting
    in one) changes nothing."""
    gen = torch.Generator().manual_seed(ways * 100 + min_partition + block_n)
    lens = [300, 3, 150, 64] if block_size == 16 else [300, 40]
    k_cache, v_cache, tables = paged_cache(lens, block_size, KV_HEADS, 64, gen, extra_cols=4)
    query = torch.randn(len(lens), KV_HEADS * 4, 64, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    args = (query, k_cache, v_cache, tables, context_lens, 0.125)
    unsplit = tatt.paged_decode_attention_impl(*args, num_partitions=1)
    split = tatt.paged_decode_attention_impl(*args, num_partitions=ways, min_partition=min_partition, block_n=block_n)
    close(split, unsplit, rtol=1e-5, atol=1e-6)
    close(split, ref.paged_decode_attention(*args))


def test_decode_whole_tiles_match_masked_loop(monkeypatch):
    """Whole key tiles take an unmasked loop (one base address a tile); with it off every tile takes
    the masked one. Same results, for contexts of whole tiles, a part tile, and one short of a block,
    and under a register cap (which the interpreter ignores; the argument must still pass)."""
    gen = torch.Generator().manual_seed(11)
    lens = [256, 300, 255, 64, 3]
    k_cache, v_cache, tables = paged_cache(lens, 256, KV_HEADS, 64, gen)
    query = torch.randn(len(lens), KV_HEADS * 2, 64, generator=gen)
    args = (query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    monkeypatch.setitem(tatt.DECODE_LAUNCH, "model", tatt.DecodeLaunch(4, whole_tiles=True))
    whole = tatt.paged_decode_attention_impl(*args, max_registers=128)
    monkeypatch.setitem(tatt.DECODE_LAUNCH, "model", tatt.DecodeLaunch(4, whole_tiles=False))
    masked = tatt.paged_decode_attention_impl(*args)
    close(whole, masked, rtol=1e-5, atol=1e-6)
    close(whole, ref.paged_decode_attention(*args))


def test_decode_bulk_copied_whole_tiles():
    """Whole tiles by bulk copy (DecodeLaunch.tma; the interpreter emulates the copies) give what
    each thread's loads give, beside part tiles, in one partition or several; a cache whose rows
    cannot be bulk-copied (head size 80, short of its power of two) takes the loads instead."""
    gen = torch.Generator().manual_seed(12)
    lens = [256, 300, 255, 64, 3]
    for head_dim in (64, 80):
        k_cache, v_cache, tables = paged_cache(lens, 256, KV_HEADS, head_dim, gen)
        query = torch.randn(len(lens), KV_HEADS * 2, head_dim, generator=gen)
        args = (query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5)
        d_pad = tatt.next_pow2(head_dim)
        assert tatt._tma_ok(k_cache, head_dim, d_pad) == (head_dim == 64)
        for ways in (1, 3):
            bulk = tatt.paged_decode_attention_impl(*args, num_partitions=ways, min_partition=64,
                                                    launch=tatt.DecodeLaunch(4, tma=True))
            loads = tatt.paged_decode_attention_impl(*args, num_partitions=ways, min_partition=64,
                                                     launch=tatt.DecodeLaunch(4))
            close(bulk, loads, rtol=1e-5, atol=1e-6)
            close(bulk, ref.paged_decode_attention(*args))


@pytest.mark.parametrize("tma", [False, True])
def test_decode_table_entries_read_ahead(tma):
    """The whole-tile loop holding TABLE_AHEAD table entries in registers at a time (chunks that
    end mid-partition, partitions that start mid-chunk, shuffled blocks) gives what one entry
    loaded a tile gives, through each thread's loads and through bulk copies."""
    gen = torch.Generator().manual_seed(13)
    lens = [300, 16, 161, 47]
    k_cache, v_cache, tables = paged_cache(lens, 16, KV_HEADS, 64, gen)
    query = torch.randn(len(lens), KV_HEADS * 2, 64, generator=gen)
    args = (query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    for ways in (1, 3):
        one_a_tile = tatt.paged_decode_attention_impl(*args, num_partitions=ways, min_partition=16, block_n=16,
                                                      launch=tatt.DecodeLaunch(4, tma=tma))
        ahead = tatt.paged_decode_attention_impl(*args, num_partitions=ways, min_partition=16, block_n=16,
                                                 launch=tatt.DecodeLaunch(4, tma=tma, table_ahead=4))
        close(ahead, one_a_tile, rtol=1e-5, atol=1e-6)
        close(ahead, ref.paged_decode_attention(*args))


def test_decode_partition_heuristic():
    """Few sequences on a long table split (to fill the GPU); a full batch does not; a short
    table never splits below the minimum partition length."""
    cpu = torch.device("cpu")  # 4 'SMs' off CUDA: the target is 8 programs
    assert tatt.decode_num_partitions(1, 2, 128, 256, cpu) == 4  # 32k tokens
    assert tatt.decode_num_partitions(1, 1, 128, 256, cpu) == 8
    assert tatt.decode_num_partitions(256, 8, 8, 256, cpu) == 1
    shortest = tatt.DECODE_MIN_PARTITION
    assert tatt.decode_num_partitions(1, 1, 1, 16, cpu) == 1  # 16 tokens: one partition at most
    assert tatt.decode_num_partitions(1, 1, 2, shortest, cpu) == 2  # a table of two shortest partitions
    assert tatt.decode_num_partitions(1, 1, 8, shortest, cpu) == 8


# ---------------------------------------------------------------------------------------------
# Prefill attention

PREFILL_CASES = [  # (group, head_dim, block_size)
    (1, 64, 16), (2, 128, 16), (4, 64, 16), (8, 64, 16), (4, 16, 16), (2, 64, 256),
]


@pytest.mark.parametrize("group,head_dim,block_size", PREFILL_CASES)
def test_prefill_attention(group, head_dim, block_size):
    gen = torch.Generator().manual_seed(7 * group + head_dim + block_size)
    # (new queries, KV entries after the chunk): plain prompt, cached prefix, one token, empty.
    shapes = [(37, 37), (20, 150), (1, 77), (0, 16), (70, 90)]
    q_lens = [q for q, _ in shapes]
    lens = [n for _, n in shapes]
    k_cache, v_cache, tables = paged_cache(lens, block_size, KV_HEADS, head_dim, gen, ahead=[0, 1, 0, 0, 1])
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), KV_HEADS * group, head_dim, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    args = (query, k_cache, v_cache, tables, cu, context_lens, scale)
    expected = ref.prefill_attention(*args)
    out = tatt.prefill_attention(*args)
    close(out, expected)
    if group == 2 and block_size == 16:  # other tilings: several query tiles per sequence
        close(tatt.prefill_attention_impl(*args, block_m=16, block_n=32), expected)


@pytest.mark.parametrize("tma,heads_fast", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 8)])
def test_prefill_attention_launch_shapes(tma, heads_fast, block_m, block_n):
    """Every launch shape the GPU may pick (bulk-copied full tiles, heads side by side, tiles of
    several sizes) computes the same attention: full tiles, diagonal tiles and a cached prefix."""
    gen = torch.Generator().manual_seed(block_m + block_n + 2 * tma + heads_fast)
    shapes = [(70, 70), (33, 120), (1, 40), (48, 64)]
    block_size, head_dim, group = 16, 32, 2
    lens = [n for _, n in shapes]
    k_cache, v_cache, tables = paged_cache(lens, block_size, KV_HEADS, head_dim, gen, ahead=[1, 0, 0, 1])
    cu = torch.tensor([0] + torch.tensor([q for q, _ in shapes]).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), KV_HEADS * group, head_dim, generator=gen)
    args = (query, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5)
    tiles = tatt.PrefillTiles(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, tma=tma,
                              heads_fast=heads_fast)
    close(tatt.prefill_attention_impl(*args, tiles=tiles), ref.prefill_attention(*args))


# ---------------------------------------------------------------------------------------------
# Scores

WINDOW_CASES = [  # (group, head_dim, block_size, window, kv_len)
    (1, 64, 16, 16, 100), (2, 128, 16, 8, 150), (4, 64, 16, 16, 600), (8, 64, 16, 4, 60),
    (4, 16, 16, 8, 90), (2, 64, 256, 16, 300),
]


@pytest.mark.parametrize("group,head_dim,block_size,window,kv_len", WINDOW_CASES)
def test_window_attention_score(group, head_dim, block_size, window, kv_len):
    gen = torch.Generator().manual_seed(group + head_dim + window + kv_len)
    k_cache, _, tables = paged_cache([kv_len], block_size, KV_HEADS, head_dim, gen)
    table = tables[0][tables[0] >= 0].long()  # the compressor passes an int64 1-D table
    queries = torch.randn(window, KV_HEADS * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    expected = ref.window_attention_score(queries, k_cache, table, kv_len, scale)
    out = tscores.window_attention_score(queries, k_cache, table, kv_len, scale)
    assert out.dtype == torch.float32 and out.shape == (KV_HEADS, kv_len)
    close(out, expected)
    if group == 1:
        close(tscores.window_attention_score(queries, k_cache, table.int(), kv_len, scale), expected)


@pytest.mark.parametrize("kernel", [3, 5])
def test_pool_scores(kernel):
    gen = torch.Generator().manual_seed(kernel)
    scores = torch.randn(3, 101, generator=gen)
    scores[0, -5:] = float("inf")
    scores[1, :3] = float("-inf")
    close(tscores.pool_scores(scores, kernel), ref.pool_scores(scores, kernel), rtol=0, atol=0)


@pytest.mark.parametrize("num_previous", [0, 40, 101])
def test_global_score_merge(num_previous):
    gen = torch.Generator().manual_seed(num_previous)
    current = torch.rand(KV_HEADS, 101, generator=gen)
    previous = torch.rand(101, KV_HEADS, generator=gen).t()  # strided, as the compressor builds it
    out = tscores.global_score_merge(current, previous, num_previous, 0.8)
    close(out, ref.global_score_merge(current, previous, num_previous, 0.8), rtol=0, atol=0)


def duplicated_keys(gen, tokens=150, head_dim=64, heads=KV_HEADS):
    """Random keys with runs of near-duplicates (cosine ~0.96) and a few exact repeats."""
    keys = torch.randn(heads, tokens, head_dim, generator=gen)
    keys[:, 10:20] = keys[:, 0:10] + 0.3 * torch.randn(heads, 10, head_dim, generator=gen)
    keys[:, 40:45] = keys[:, 30:31] + 0.2 * torch.randn(heads, 5, head_dim, generator=gen)
    keys[:, 100] = keys[:, 60] * 2.0
    keys[:, 140:] = keys[:, 135:136] + 0.1 * torch.randn(heads, tokens - 140, head_dim, generator=gen)
    return keys


def reference_sums(keys, lightning_block, threshold):
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    heads, tokens, dim = unit.shape
    if lightning_block is None:
        return ref._redundancy_sums(unit, threshold)
    padded = torch.nn.functional.pad(unit, (0, 0, 0, -tokens % lightning_block))
    blocks = padded.reshape(-1, lightning_block, dim)
    return ref._redundancy_sums(blocks, threshold).reshape(heads, -1)[:, :tokens]


@pytest.mark.parametrize("lightning_block,threshold", [(None, 0.5), (16, 0.5), (64, 0.5), (32, -0.2), (None, -0.2)])
def test_redundancy_score(lightning_block, threshold):
    gen = torch.Generator().manual_seed(3 + (lightning_block or 0))
    # [T, heads, D] gathered from the cache and transposed, as the compressor passes it
    keys = duplicated_keys(gen).transpose(0, 1).contiguous().transpose(0, 1)
    assert not keys.is_contiguous()
    close(tscores.redundancy_sums(keys, lightning_block, threshold), reference_sums(keys, lightning_block, threshold),
          rtol=1e-4, atol=1e-4)
    out = tscores.redundancy_score(keys, lightning_block, threshold, 0.4)
    close(out, ref.redundancy_score(keys, lightning_block, threshold, 0.4))
    if lightning_block == 16:  # tiles spanning several lightning blocks
        close(tscores.redundancy_sums(keys, lightning_block, threshold, tile=64),
              reference_sums(keys, lightning_block, threshold), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lightning_block", [None, 16])
def test_redundancy_sums_from_16_bit_unit_keys(lightning_block):
    """16-bit keys (as a bf16 or fp16 engine passes them) are normalised once into unit keys of their
    own dtype, whose products run on 16-bit tensor cores: the sums stay within 1e-3 of the float32
    definition. fp16 stands in for bf16 here: the interpreter's bf16 tl.dot is wrong; the GPU check
    covers bf16."""
    gen = torch.Generator().manual_seed(11 + (lightning_block or 0))
    keys = duplicated_keys(gen).transpose(0, 1).contiguous().transpose(0, 1)
    got = tscores.redundancy_sums(keys.half(), lightning_block, 0.5)
    want = reference_sums(keys.half(), lightning_block, 0.5)
    assert got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < 1e-3


def test_redundancy_spares_latest_duplicate():
    """A run of exact duplicates: only the newest looks unique."""
    keys = torch.zeros(1, 6, 16)
    keys[0, :, 0] = 1.0  # all identical
    keys[0, 5] = torch.tensor([0.0, 1.0] + [0.0] * 14)
    sums = tscores.redundancy_sums(keys, None, 0.5)
    close(sums, reference_sums(keys, None, 0.5), rtol=0, atol=1e-6)
    assert sums[0, 4] == 0 and sums[0, 0] > 0


@pytest.mark.parametrize("tokens,keep", [(300, 128), (300, 300), (1000, 1), (2304, 2048)])
def test_keep_indices_matches_topk(tokens, keep):
    gen = torch.Generator().manual_seed(tokens + keep)
    scores = torch.randn(KV_HEADS + 1, tokens, generator=gen)
    scores[:, -16:] = float("inf")  # the window
    scores[:, 3] = -0.0
    out = tscores.keep_indices(scores, keep)
    expected = ref.keep_indices(scores, keep)
    assert out.dtype == torch.int64 and out.shape == (KV_HEADS + 1, keep)
    assert torch.equal(out, expected)


def assert_valid_top_k(scores, out, keep):
    assert out.shape == (scores.shape[0], keep)
    for row, idx in zip(scores, out):
        assert torch.all(idx[1:] > idx[:-1]), "indices must be strictly ascending"
        chosen = torch.zeros(scores.shape[1], dtype=torch.bool)
        chosen[idx] = True
        if keep < scores.shape[1]:
            assert row[chosen].min() >= row[~chosen].max()


def test_keep_indices_with_ties(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (3, 500), generator=gen).float()
    scores[:, -16:] = float("inf")
    scores[2, :] = 1.0  # one value only: the lowest indices win
    out = tscores.keep_indices(scores, 200)
    assert_valid_top_k(scores, out, 200)
    assert torch.equal(out[2], torch.arange(200))
    # The chunked path (rows longer than one chunk), forced with a tiny chunk.
    monkeypatch.setattr(tscores, "KEEP_MAX_CHUNK", 64)
    chunked = tscores.keep_indices(scores, 200)
    assert torch.equal(chunked, out)
    plain = torch.randn(2, 333, generator=gen)
    assert torch.equal(tscores.keep_indices(plain, 100), ref.keep_indices(plain, 100))


# ---------------------------------------------------------------------------------------------
# Compaction


@pytest.mark.parametrize("with_scores", [True, False])
def test_compact_kv_overlapping(with_scores):
    """Targets are blocks the kept entries come from: everything is gathered before it is written."""
    gen = torch.Generator().manual_seed(11)
    block_size, head_dim, num_blocks = 16, 64, 9
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=gen)
    score_cache = torch.randn(num_blocks * block_size, KV_HEADS, generator=gen)
    table = torch.tensor([3, 0, 7, 1, 6])
    kv_len, keep = 75, 48
    token_slots = (table[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:kv_len]
    keep_idx = ref.keep_indices(torch.randn(KV_HEADS, kv_len, generator=gen), keep)
    src = token_slots[keep_idx]
    targets = [0, 3, 7]  # all sources of the kept entries' first blocks
    dst = torch.tensor([b * block_size + o for b in targets for o in range(block_size)])
    kept_scores = torch.randn(KV_HEADS, keep, generator=gen) if with_scores else None
    caches = [k_cache.clone(), v_cache.clone(), score_cache.clone() if with_scores else None]
    ref.compact_kv(*caches, src, dst, kept_scores)
    tcache.compact_kv(k_cache, v_cache, score_cache if with_scores else None, src, dst, kept_scores)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    if with_scores:
        assert torch.equal(score_cache, caches[2])


# ---------------------------------------------------------------------------------------------
# Fused elementwise chains of a decoder layer

from zipage.kernels import triton_fused as tfused  # noqa: E402


@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_and_add_rms_norm(hidden):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, hidden, generator=gen)
    residual = torch.randn(5, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    close(tfused.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    normed, summed = tfused.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = ref.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    close(normed, ref_normed)


@pytest.mark.parametrize("n", [48, 1500])
def test_silu_and_mul(n):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 2 * n, generator=gen) * 4
    close(tfused.silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("group,head_dim,block_size,query_store", [
    (2, 64, 16, True), (4, 128, 16, False), (1, 16, 256, True), (8, 64, 16, False)])
def test_qk_norm_rope_store(norm, group, head_dim, block_size, query_store):
    """q returned, K/V in their slots (-1 skipped), queries in their rows (-1 skipped); caches
    are layer views of a larger tensor and qkv carries a bias-like offset: strides are real."""
    gen = torch.Generator().manual_seed(13)
    tokens, q_heads = 9, KV_HEADS * group
    width = (q_heads + 2 * KV_HEADS) * head_dim
    qkv = torch.randn(tokens, width + 8, generator=gen)[:, 3:3 + width]  # a strided view
    positions = torch.tensor([0, 1, 2, 7, 30, 31, 5, 63, 12])
    length = 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(length).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    rows = torch.stack((emb.cos(), emb.sin()), dim=1)[positions]  # the engine's layout: strided views
    cos, sin = rows[:, 0], rows[:, 1]
    q_norm = torch.rand(head_dim, generator=gen) + 0.5 if norm else None
    k_norm = torch.rand(head_dim, generator=gen) + 0.5 if norm else None
    caches = torch.randn(2, 2, 4, block_size, KV_HEADS, head_dim, generator=gen)
    k_cache, v_cache = caches[1, 0], caches[1, 1]
    slots = torch.randperm(4 * block_size, generator=gen)[:tokens]
    slots[[1, 6]] = -1
    qcache = torch.randn(2, 12, q_heads, head_dim, generator=gen)[0] if query_store else None
    qslots = torch.tensor([3, -1, 0, 11, -1, 5, 6, -1, 1]) if query_store else None
    expected = [caches.clone(), qcache.clone() if query_store else None]
    q_ref = ref.qk_norm_rope_store(qkv, cos, sin, q_norm, k_norm, 1e-6, expected[0][1, 0],
                                   expected[0][1, 1], slots, expected[1], qslots)
    q = tfused.qk_norm_rope_store(qkv, cos, sin, q_norm, k_norm, 1e-6, k_cache, v_cache, slots,
                                  qcache, qslots)
    close(q, q_ref)
    close(caches, expected[0])
    if query_store:
        close(qcache, expected[1])


# ---------------------------------------------------------------------------------------------
# Skinny products of decode (x of 1-16 rows), with their fused prologues

from zipage.kernels import triton_linear as tlin  # noqa: E402

# Column tiles that overhang N, K tails, splits whose last share is short, both inner products.
SKINNY_CONFIGS = [tlin.Config(16, 32), tlin.Config(32, 64, split_k=3), tlin.Config(16, 32, split_k=2, dot=False),
                  tlin.Config(16, 64, dot=False)]
SKINNY_SHAPES = [(40, 72), (130, 200), (64, 128)]  # (N, K); the last divides every tile
SKINNY_ROWS = [1, 3, 16]


def skinny_inputs(rows, n, k, seed, x_cols=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, x_cols or k, generator=gen)
    return x, torch.randn(n, k, generator=gen) / k ** 0.5, torch.randn(n, generator=gen), gen


def skinny_id(cfg):
    return f"n{cfg.block_n}k{cfg.block_k}s{cfg.split_k}{'dot' if cfg.dot else 'sum'}"


@pytest.mark.parametrize("cfg", SKINNY_CONFIGS, ids=skinny_id)
@pytest.mark.parametrize("n,k", SKINNY_SHAPES)
@pytest.mark.parametrize("rows", SKINNY_ROWS)
def test_skinny_linear(rows, n, k, cfg):
    x, w, b, _ = skinny_inputs(rows, n, k, rows * 7 + n)
    out, summed = tlin.skinny_matmul(x, w, b, config=cfg)
    assert summed is None
    close(out, ref.linear(x, w, b))
    close(tlin.skinny_matmul(x, w, None, config=cfg)[0], ref.linear(x, w, None))


@pytest.mark.parametrize("cfg", SKINNY_CONFIGS, ids=skinny_id)
@pytest.mark.parametrize("n,k", SKINNY_SHAPES)
@pytest.mark.parametrize("rows", SKINNY_ROWS)
def test_norm_linear(rows, n, k, cfg):
    x, w, b, gen = skinny_inputs(rows, n, k, rows * 11 + k)
    residual = torch.randn(rows, k, generator=gen)
    norm_w = torch.rand(k, generator=gen) + 0.5
    out, summed = tlin.skinny_matmul(x, w, b, tlin.ADD_NORM, residual, norm_w, 1e-6, config=cfg)
    expected, expected_sum = ref.norm_linear(x, residual, norm_w, 1e-6, w, b)
    assert torch.equal(summed, expected_sum)
    assert summed.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    close(out, expected)
    out, _ = tlin.skinny_matmul(x, w, None, tlin.NORM, None, norm_w, 1e-5, config=cfg)
    close(out, ref.norm_linear(x, None, norm_w, 1e-5, w, None)[0])


@pytest.mark.parametrize("cfg", SKINNY_CONFIGS, ids=skinny_id)
@pytest.mark.parametrize("n,k", SKINNY_SHAPES)
@pytest.mark.parametrize("rows", SKINNY_ROWS)
def test_silu_mul_linear(rows, n, k, cfg):
    x, w, _, _ = skinny_inputs(rows, n, k, rows * 13 + n + k, x_cols=2 * k)
    close(tlin.skinny_matmul(x * 3, w, None, tlin.SILU_MUL, config=cfg)[0], ref.silu_mul_linear(x * 3, w, None))


@pytest.mark.parametrize("shape", sorted(tlin.TABLE), ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_skinny_committed_table(shape):
    """Each committed config, one row and several, on a shape that walks all its splits and two
    column tiles (the table's real shapes are too large for the interpreter): the reference's result
    for the plain product and the SiLU-and-multiply prologue."""
    for rows, cfg in zip((1, 5), tlin.TABLE[shape]):
        n, k = 2 * cfg.block_n, 2 * cfg.block_k * cfg.split_k
        x, w, b, _ = skinny_inputs(rows, n, k, shape[0] + rows, x_cols=2 * k)
        close(tlin.skinny_matmul(x[:, :k].contiguous(), w, b, config=cfg)[0], ref.linear(x[:, :k], w, b),
              rtol=1e-4, atol=1e-4)
        close(tlin.skinny_matmul(x, w, None, tlin.SILU_MUL, config=cfg)[0], ref.silu_mul_linear(x, w, None),
              rtol=1e-4, atol=1e-4)


def test_skinny_split_k_is_repeatable():
    """The split-K counters are back at zero after every product: a second call (a graph replay)
    sums the same partials in the same order, bit for bit."""
    x, w, b, _ = skinny_inputs(5, 130, 200, 3)
    cfg = tlin.Config(16, 32, split_k=4)
    first = tlin.skinny_matmul(x, w, b, config=cfg)[0]
    assert torch.equal(tlin.skinny_matmul(x, w, b, config=cfg)[0], first)
    assert not tlin._counters[x.device].any()


@pytest.mark.parametrize("fold", [tlin.MAX_ROWS, 0])
def test_skinny_public_signatures(fold, monkeypatch):
    """The dispatch-facing functions: default configs, leading dims, bias, more rows than a skinny
    product takes (the cuBLAS/fused-kernel chain), and with the norm and SiLU as their own kernels
    before the skinny product (fold 0)."""
    monkeypatch.setattr(tlin, "FOLD_MAX_ROWS", fold)
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    norm_w = torch.rand(80, generator=gen) + 0.5
    for rows in (1, 7, tlin.MAX_ROWS + 5):
        x = torch.randn(rows, 80, generator=gen)
        res = torch.randn(rows, 80, generator=gen)
        close(tlin.linear(x, w, b), ref.linear(x, w, b))
        out, summed = tlin.norm_linear(x, res, norm_w, 1e-6, w, b)
        expected, expected_sum = ref.norm_linear(x, res, norm_w, 1e-6, w, b)
        close(out, expected)
        close(summed, expected_sum)
        out, same = tlin.norm_linear(x, None, norm_w, 1e-6, w, None)
        assert same is x
        close(out, ref.norm_linear(x, None, norm_w, 1e-6, w, None)[0])
        gu = torch.randn(rows, 160, generator=gen)
        close(tlin.silu_mul_linear(gu, w, b), ref.silu_mul_linear(gu, w, b))
    x3 = torch.randn(2, 3, 80, generator=gen)
    close(tlin.linear(x3, w, b), ref.linear(x3, w, b))
    strided = torch.randn(4, 100, generator=gen)[:, 10:90]  # rows not contiguous with each other
    close(tlin.linear(strided, w, None), ref.linear(strided, w, None))


def test_skinny_bf16():
    """bf16 in, fp32 accumulation, one rounding on the store. Broadcast-and-sum only, and no
    residual add: the interpreter mangles bf16 dots and bf16 adds (those run on the GPU,
    benchmarks/gpu_check.py)."""
    x, w, b, gen = skinny_inputs(3, 130, 200, 5)
    up = torch.randn(3, 200, generator=gen)
    norm_w = torch.rand(200, generator=gen) + 0.5
    xb, wb, bb, ub, nb = (t.bfloat16() for t in (x, w, b, up, norm_w))
    for cfg in (tlin.Config(32, 64, split_k=3, dot=False), tlin.Config(16, 64, dot=False)):
        out = tlin.skinny_matmul(xb, wb, bb, config=cfg)[0]
        assert out.dtype == torch.bfloat16
        close(out.float(), ref.linear(xb.float(), wb.float(), bb.float()), rtol=2e-2, atol=2e-2)
        out = tlin.skinny_matmul(xb, wb, None, tlin.NORM, None, nb, 1e-6, config=cfg)[0]
        close(out.float(), ref.norm_linear(xb, None, nb, 1e-6, wb, None)[0].float(), rtol=2e-2, atol=2e-2)
        out = tlin.skinny_matmul(torch.cat((xb, ub), dim=1), wb, None, tlin.SILU_MUL, config=cfg)[0]
        expected = ref.silu_mul_linear(torch.cat((xb, ub), dim=1), wb, None)
        close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen2-tiny", "llama-tiny"])
def test_decoder_skinny_path(family, monkeypatch):
    """A decode forward through the layers' skinny path (norms and SiLU folded into the products)
    equals the plain path: with the reference compositions, and with the Triton kernels."""
    from zipage.engine.loading.model_registry import RANDOM_PRESETS
    from zipage.engine.execution.models import ForwardBatch
    from zipage.engine.execution.models.decoder import CausalLM

    torch.manual_seed(0)
    model = CausalLM(RANDOM_PRESETS[family].make_config())
    model.init_random(seed=1)
    gen = torch.Generator().manual_seed(6)
    attn = model.attention_layers[0]
    lens = [5, 17, 9]
    for layer in model.attention_layers:
        layer.k_cache, layer.v_cache, tables = paged_cache(lens, 16, attn.num_kv_heads, attn.head_dim, gen)
    batch = ForwardBatch(is_prefill=False, slot_mapping=torch.tensor([4, 40, 60]), block_tables=tables,
                         context_lens=torch.tensor(lens, dtype=torch.int32))
    ids, positions = torch.tensor([3, 7, 11]), torch.tensor([4, 16, 8])

    def forward(skinny):
        hidden, residual = model._embed(ids), None
        cos_sin = model.rope.cos_sin(positions)
        for layer in model.model.layers:
            hidden, residual = layer(hidden, residual, cos_sin, batch, skinny)
        return hidden, residual

    plain = forward(False)
    for got, want in zip(forward(True), plain):
        assert torch.equal(got, want)
    for name in kernels.SKINNY_NAMES:  # what the dispatch seam does on CUDA
        monkeypatch.setattr(kernels, name, getattr(tlin, name))
    for got, want in zip(forward(True), plain):
        close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# Sampling


def sampling_batch(vocab: int, gen: torch.Generator):
    """Rows of every kind the sampler sees at once: no filter, top-k alone and with top-p and min-p,
    top-p alone, ties at the k-th logit (bf16-rounded logits, as a bf16 head gives them), a row a
    grammar masks down to a few tokens, and uniforms at both ends of [0, 1)."""
    from zipage.engine import SamplingParams
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02), SamplingParams(temperature=1.0, min_p=0.05),
              SamplingParams(temperature=0.5, top_p=0.3), SamplingParams(temperature=1.0, top_k=20)]
    logits = (torch.randn(len(params), vocab, generator=gen) * torch.tensor([3.0, 1, 6, 0.5, 2, 3, 1, 0.5])[:, None])
    logits = logits.bfloat16().float()
    kth = logits[7].sort(descending=True).values[19]
    logits[7, torch.randperm(vocab, generator=gen)[:30]] = kth  # a tie of the k-th logit past the top-k
    logits[1, 3:] = float("-inf")  # a grammar leaves 3 tokens
    uniforms = torch.rand(len(params), dtype=torch.float64, generator=gen).tolist()
    uniforms[0], uniforms[-1] = 0.0, 1 - 2 ** -53
    return logits, params, uniforms


@pytest.mark.parametrize("vocab", [300, 5000], ids=["one-chunk", "three-chunks"])
@pytest.mark.parametrize("subset", ["all", "unfiltered", "top-k", "top-k-alone", "top-p"])
def test_sample_rows(vocab, subset):
    """The Triton draw takes the reference's token on every row, with the candidates the CUDA sampler
    ranks (a row's top-k, or every row sorted whole where a filtering row has none)."""
    from zipage.engine.execution.sampler import rank, sampling_table
    from zipage.kernels.sampling import triton_sampling
    gen = torch.Generator().manual_seed(vocab)
    for attempt in range(3):
        logits, params, uniforms = sampling_batch(vocab, gen)
        rows = {"all": range(len(params)), "unfiltered": [0], "top-k": [1, 2, 4, 7], "top-k-alone": [1, 7],
                "top-p": [3, 5, 6]}[subset]
        if attempt == 0:  # each row drawn at 12 points spread over [0, 1): every part of its distribution
            rows = [r for r in rows for _ in range(12)]
            uniforms = [(i % 12 + 0.5) / 12 for i in range(len(rows))]
        else:
            uniforms = [uniforms[r] for r in rows]
        logits, params = logits[list(rows)], [params[r] for r in rows]
        ranked, asks = rank(logits, params, may_sync=False)
        table = sampling_table(params, uniforms, logits)
        want = ref.sample_rows(logits, table, ranked, asks)
        got = triton_sampling.sample_rows(logits, table, ranked, asks)
        assert got.tolist() == want.tolist()
        kept = torch.isfinite(ref.filtered_rows(logits, table, ranked, asks))
        assert kept.gather(-1, got[:, None]).all()  # never a token the filters dropped
