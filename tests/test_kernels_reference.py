"""zipage_kernels/reference.py against naive dense attention computed from unpaged K/V.

Each case builds per-sequence dense K/V, scatters them into a paged cache through a shuffled
block table (padded with -1), and checks the paged kernels against a straightforward
softmax(q k^T * scale) v loop.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from zipage import kernels
from zipage.kernels import reference

GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (q heads, kv heads): ratios 1, 2, 4, 8
HEAD_DIMS = [64, 128]
BLOCK_SIZES = [16, 256]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float) -> torch.Tensor:
    """q [nq, H, D] at absolute positions q_pos; k, v [L, KH, D]. Query at position p sees keys 0..p.

    Dense float64 math: every query head reads kv head h // (H / KH)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kv_of_head = torch.arange(heads) // (heads // kv_heads)
    kd = k.double()[:, kv_of_head]  # [L, H, D]
    vd = v.double()[:, kv_of_head]
    scores = torch.einsum("qhd,lhd->hql", q.double(), kd) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(q_pos)[:, None]  # [nq, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), vd)


class PagedCase:
    """Random ragged sequences stored in a paged cache with shuffled blocks and -1 padding."""

    def __init__(self, lengths, kv_heads, head_dim, block_size, seed, extra_blocks=3):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        self.block_size = block_size
        per_seq = [-(-n // block_size) for n in lengths]
        num_blocks = sum(per_seq) + extra_blocks  # some blocks belong to nobody
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)  # garbage
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(per_seq) + 1  # always at least one -1 of padding
        self.tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
        self.keys, self.values = [], []
        for i, n in enumerate(lengths):
            blocks = [order.pop() for _ in range(per_seq[i])]
            self.tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            k = torch.randn(n, kv_heads, head_dim, generator=gen)
            v = torch.randn(n, kv_heads, head_dim, generator=gen)
            slots = torch.tensor([blocks[j // block_size] * block_size + j % block_size for j in range(n)])
            reference.store_kv(k, v, self.k_cache, self.v_cache, slots)
            self.keys.append(k)
            self.values.append(v)
        self.gen = gen


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_paged_decode_attention_matches_dense(heads, kv_heads, head_dim, block_size):
    lengths = [1, 17, block_size + 3, 2 * block_size, 5]
    case = PagedCase(lengths, kv_heads, head_dim, block_size, seed=heads * 1000 + head_dim + block_size)
    q = torch.randn(len(lengths), heads, head_dim, generator=case.gen)
    scale = 1 / math.sqrt(head_dim)
    out = reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.tables,
                                           torch.tensor(lengths, dtype=torch.int32), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, n in enumerate(lengths):
        want = naive_attention(q[i:i + 1], case.keys[i], case.values[i], [n - 1], scale)
        torch.testing.assert_close(out[i:i + 1].double(), want, rtol=1e-4, atol=1e-5)
    # The dispatch seam sends CPU tensors to the reference.
    torch.testing.assert_close(kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.tables,
                                                              torch.tensor(lengths, dtype=torch.int32), scale), out)


def test_decode_reads_worked_out_once_serve_every_layer_alike():
    """A forward works out its reads once (decode_reads) and every layer passes them in: the same
    output as reading the tables in each call, for a batch and for one sequence alone (only its
    context's blocks; a table with a hole inside the context masks it, as in a batch). A sequence's
    output is bit-for-bit the same alone as in the batch: outputs must not depend on batching."""
    lengths = [1, 17, 35, 32, 5]
    case = PagedCase(lengths, 2, 64, 16, seed=21)
    q = torch.randn(len(lengths), 8, 64, generator=case.gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    reads = reference.decode_reads(case.tables, lens, 16)
    assert reads.mask.shape == (5, 1, 1, case.tables.shape[1] * 16)
    batched = reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.tables, lens, 0.125, reads=reads)
    assert torch.equal(batched, reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.tables, lens, 0.125))
    for i, n in enumerate(lengths):
        alone = reference.decode_reads(case.tables[i:i + 1], lens[i:i + 1], 16)
        whole = -(-n // 16)
        assert alone.blocks.tolist() == case.tables[i, :whole].tolist()
        assert alone.mask.shape == (1, 1, 1, whole * 16) and alone.mask.isinf().sum() == whole * 16 - n
        one = reference.paged_decode_attention(q[i:i + 1], case.k_cache, case.v_cache, case.tables[i:i + 1],
                                               lens[i:i + 1], 0.125, reads=alone)
        assert torch.equal(one, batched[i:i + 1]), i
    holed = case.tables[2:3].clone()
    holed[0, 1] = -1  # entries 16..31 unreadable: masked, as in a batch
    assert reference.decode_reads(holed, lens[2:3], 16).mask.isinf().sum() > 0


def test_lone_sequence_on_one_run_of_blocks_reads_in_place():
    """A lone sequence whose blocks are one ascending run reads the cache as a view of those blocks:
    bit for bit what gathering them gives, scales of an 8-bit cache included. Anything else (a
    batch, blocks out of order, a hole) gathers."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 12, 16, 2, 64, generator=gen).unbind(0)
    q = torch.randn(1, 8, 64, generator=gen)
    table = torch.tensor([[3, 4, 5, 6, -1]], dtype=torch.int32)
    lens = torch.tensor([55], dtype=torch.int32)
    reads = reference.decode_reads(table, lens, 16)
    assert reads.run == (3, 4)
    gathered = dataclasses.replace(reads, run=None)
    for scales in ({}, None):
        if scales is None:  # an int8 cache: codes and scales read the same way
            k8, ks = reference.quantize_rows(k_cache, torch.int8)
            v8, vs = reference.quantize_rows(v_cache, torch.int8)
            caches, scales = (k8, v8), {"k_scales": ks, "v_scales": vs}
        else:
            caches = (k_cache, v_cache)
        in_place = reference.paged_decode_attention(q, *caches, table, lens, 0.125, reads=reads, **scales)
        copied = reference.paged_decode_attention(q, *caches, table, lens, 0.125, reads=gathered, **scales)
        assert torch.equal(in_place, copied)
    for other in ([[3, 5, 6, 7]], [[6, 5, 4, 3]], [[-1, 4, 5, 6]]):
        assert reference.decode_reads(torch.tensor(other, dtype=torch.int32), lens, 16).run is None
    batch = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]], dtype=torch.int32)
    assert reference.decode_reads(batch, torch.tensor([55, 60], dtype=torch.int32), 16).run is None


def test_paged_decode_attention_ignores_cache_beyond_context():
    """Entries past context_len in the last block (stale garbage) must not leak into the output."""
    case = PagedCase([10, 3], 2, 64, 16, seed=5)
    q = torch.randn(2, 4, 64, generator=case.gen)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    before = reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.tables, lens, 0.125)
    # Overwrite everything outside the valid entries with huge values.
    k2, v2 = case.k_cache.clone(), case.v_cache.clone()
    mask = torch.ones(k2.shape[:2], dtype=torch.bool)
    for i, n in enumerate([10, 3]):
        for j in range(n):
            mask[case.tables[i, j // 16], j % 16] = False
    k2[mask] = 1e4
    v2[mask] = 1e4
    after = reference.paged_decode_attention(q, k2, v2, case.tables, lens, 0.125)
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_attention_matches_dense_with_cached_prefix(heads, kv_heads, head_dim, block_size):
    """Ragged chunks: each sequence's queries are its last q_len entries; the rest is a cached
    prefix read through the block table (q_len == length is a plain causal prefill)."""
    lengths = [7, block_size + 5, 2 * block_size + 1, 1]
    q_lens = [7, 9, block_size + 1, 1]
    case = PagedCase(lengths, kv_heads, head_dim, block_size, seed=heads * 7 + head_dim + block_size)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=case.gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = reference.prefill_attention(q, case.k_cache, case.v_cache, case.tables, cu,
                                      torch.tensor(lengths, dtype=torch.int32), scale)
    assert out.shape == q.shape
    for i, (n, nq) in enumerate(zip(lengths, q_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = naive_attention(q[rows], case.keys[i], case.values[i], list(range(n - nq, n)), scale)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kernels.prefill_attention(q, case.k_cache, case.v_cache, case.tables, cu,
                                                         torch.tensor(lengths, dtype=torch.int32), scale), out)


def test_long_prefill_chunks_run_in_query_tiles_and_match_dense():
    """Chunks longer than a query tile (a fresh prompt, and one after a cached prefix that does not
    end on a tile edge) are attended tile by tile, each tile against only the keys it can see."""
    tile = reference.PREFILL_QUERY_TILE
    lengths, q_lens = [2 * tile + 37, 3 * tile + 5], [2 * tile + 37, 2 * tile + 3]
    case = PagedCase(lengths, 2, 32, 64, seed=17)
    q = torch.randn(sum(q_lens), 4, 32, generator=case.gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = reference.prefill_attention(q, case.k_cache, case.v_cache, case.tables, cu,
                                      torch.tensor(lengths, dtype=torch.int32), 0.2)
    for i, (n, nq) in enumerate(zip(lengths, q_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = naive_attention(q[rows], case.keys[i], case.values[i], list(range(n - nq, n)), 0.2)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-4, atol=1e-5)


def test_prefill_last_row_equals_decode():
    """The last query of a prefill and a decode step over the same context agree."""
    case = PagedCase([40, 33], 2, 64, 16, seed=9)
    q = torch.randn(40 + 33, 8, 64, generator=case.gen)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    pre = reference.prefill_attention(q, case.k_cache, case.v_cache, case.tables,
                                      torch.tensor([0, 40, 73], dtype=torch.int32), lens, 0.125)
    dec = reference.paged_decode_attention(q[[39, 72]], case.k_cache, case.v_cache, case.tables, lens, 0.125)
    torch.testing.assert_close(pre[[39, 72]], dec, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_round_trips_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(0)
    blocks, bs, kvh, d = 6, 16, 2, 64
    k_cache = torch.zeros(blocks, bs, kvh, d, dtype=dtype)
    v_cache = torch.zeros(blocks, bs, kvh, d, dtype=dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:20]
    slots[[3, 11]] = -1  # padding tokens are not stored
    k = torch.randn(20, kvh, d, generator=gen)
    v = torch.randn(20, kvh, d, generator=gen)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    keep = slots >= 0
    torch.testing.assert_close(flat_k[slots[keep]], k[keep].to(dtype))
    torch.testing.assert_close(flat_v[slots[keep]], v[keep].to(dtype))
    # Nothing else was written.
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    # gather_kv reads a sequence back in logical order through its (shuffled) block table.
    table = torch.tensor([4, 1, 5], dtype=torch.int32)
    seq_slots = torch.tensor([int(table[j // bs]) * bs + j % bs for j in range(40)])
    sk = torch.randn(40, kvh, d, generator=gen)
    reference.store_kv(sk, sk * 2, k_cache, v_cache, seq_slots)
    torch.testing.assert_close(reference.gather_kv(k_cache, table, 40), sk.to(dtype))
    torch.testing.assert_close(reference.gather_kv(v_cache, table, 40), (sk * 2).to(dtype))


def test_store_queries_copies_rows_and_skips_minus_one():
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(10, 4, 64)
    q = torch.randn(5, 4, 64, generator=gen)
    mapping = torch.tensor([7, -1, 0, -1, 3])
    kernels.store_queries(q, cache, mapping)
    torch.testing.assert_close(cache[[7, 0, 3]], q[[0, 2, 4]])
    assert not cache[[1, 2, 4, 5, 6, 8, 9]].any()


def test_layer_chains_match_transformers():
    """rms_norm, add_rms_norm, silu_and_mul and qk_norm_rope_store against transformers' own
    Qwen3 pieces (RMSNorm, apply_rotary_pos_emb, the MLP's act_fn), in float32."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    tokens, q_heads, kv_heads, d, bs = 6, 4, 2, 64, 16
    hf_norm = Qwen3RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    x, res = torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen)
    normed, summed = kernels.add_rms_norm(x, res, hf_norm.weight, 1e-6)
    torch.testing.assert_close(summed, x + res)
    torch.testing.assert_close(normed, hf_norm(x + res))
    gate_up = torch.randn(tokens, 2 * d, generator=gen)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up),
                               torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:])

    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.tensor([3, 0, 9, 4, 17, 8])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.arange(32).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    k_cache, v_cache = torch.zeros(4, bs, kv_heads, d), torch.zeros(4, bs, kv_heads, d)
    slots = torch.tensor([5, 17, -1, 40, 2, 63])
    qcache = torch.zeros(8, q_heads, d)
    q = kernels.qk_norm_rope_store(qkv, cos[positions], sin[positions], hf_norm.weight, hf_norm.weight, 1e-6,
                                   k_cache, v_cache, slots, qcache, torch.tensor([-1, 7, 0, -1, -1, 3]))
    q_in, k_in, v_in = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], -1)
    q_hf, k_hf = apply_rotary_pos_emb(hf_norm(q_in.view(tokens, q_heads, d)).transpose(0, 1),
                                      hf_norm(k_in.view(tokens, kv_heads, d)).transpose(0, 1),
                                      cos[positions], sin[positions], unsqueeze_dim=0)
    torch.testing.assert_close(q, q_hf.transpose(0, 1))
    kept = slots >= 0
    torch.testing.assert_close(k_cache.view(-1, kv_heads, d)[slots[kept]], k_hf.transpose(0, 1)[kept])
    torch.testing.assert_close(v_cache.view(-1, kv_heads, d)[slots[kept]], v_in.view(tokens, kv_heads, d)[kept])
    torch.testing.assert_close(qcache[[7, 0, 3]], q[[1, 2, 5]])
    assert not qcache[[1, 2, 4, 5, 6]].any()
