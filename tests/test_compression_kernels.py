"""The compression kernels of zipage_kernels/reference.py (scoring, selection, compaction) against naive
references written here from the definitions in docs/design-notes.md ("The score"). Loops over heads, queries and
tokens are deliberate: they are slow but obviously right at these sizes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipage import kernels

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def paged_keys(keys: torch.Tensor, block_size: int, seed: int, extra_blocks: int = 2):
    """Scatter dense keys [T, KH, D] into a garbage-filled paged cache through a shuffled block table
    padded with -1. Returns (k_cache, block_table)."""
    gen = _gen(seed)
    tokens, kv_heads, head_dim = keys.shape
    used = -(-tokens // block_size)
    num_blocks = used + extra_blocks
    cache = 100 * torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)  # loud garbage
    order = torch.randperm(num_blocks, generator=gen)[:used]
    for t in range(tokens):
        cache[order[t // block_size], t % block_size] = keys[t]
    table = torch.cat([order, torch.full((2,), -1, dtype=torch.int64)]).to(torch.int32)
    return cache, table


# ------------------------------------------------------------------------------------------
# Window attention score


def naive_window_score(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """queries [w, H, D] sit at the last w positions of keys [T, KH, D]. For every kv head h and
    token t: mean over the w window queries of (max over the query heads of h's group of the causal
    softmax probability that query puts on t). float64."""
    w, heads, _ = queries.shape
    tokens, kv_heads, _ = keys.shape
    group = heads // kv_heads
    out = torch.zeros(kv_heads, tokens, dtype=torch.float64)
    q, k = queries.double(), keys.double()
    for h in range(kv_heads):
        for i in range(w):
            pos = tokens - w + i  # this query's own KV index; it sees keys 0..pos
            best = torch.zeros(tokens, dtype=torch.float64)
            for g in range(group):
                qh = q[i, h * group + g]
                logits = torch.tensor([float(qh @ k[t, h]) * scale for t in range(pos + 1)], dtype=torch.float64)
                probs = torch.softmax(logits, dim=0)
                row = torch.zeros(tokens, dtype=torch.float64)
                row[:pos + 1] = probs
                best = torch.maximum(best, row)
            out[h] += best / w
    return out


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("tokens,window,block_size", [(37, 4, 16), (16, 8, 16), (9, 3, 4), (64, 16, 32)])
def test_window_attention_score_matches_definition(heads, kv_heads, tokens, window, block_size):
    gen = _gen(tokens * 131 + heads * 7 + kv_heads)
    head_dim = 8
    keys = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    queries = 2 * torch.randn(window, heads, head_dim, generator=gen)  # peaked softmaxes
    cache, table = paged_keys(keys, block_size, seed=tokens + heads)
    scale = head_dim ** -0.5
    got = kernels.window_attention_score(queries, cache, table, tokens, scale)
    want = naive_window_score(queries, keys, scale)
    assert got.shape == (kv_heads, tokens) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # Sanity on the definition itself: the last window query attends to every token, so the mean
    # cannot be all-zero anywhere, and the newest key is seen only by the last query.
    assert bool((got > 0).all())


def test_window_attention_score_is_causal_inside_the_window():
    """A huge key at the last position must not leak into earlier window queries."""
    gen = _gen(3)
    tokens, window, heads, kv_heads, head_dim = 20, 4, 2, 1, 4
    keys = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    queries = torch.ones(window, heads, head_dim)
    keys[-1] = 50.0  # every query would put ~all its mass on it, were it visible
    cache, table = paged_keys(keys, 8, seed=4)
    got = kernels.window_attention_score(queries, cache, table, tokens, head_dim ** -0.5)
    # Only the last of the w queries sees it (with probability ~1): mean ~ 1/w.
    assert abs(float(got[0, -1]) - 1.0 / window) < 1e-3
    torch.testing.assert_close(got.double(), naive_window_score(queries, keys, head_dim ** -0.5),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Pooling and global score


def naive_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    heads, tokens = scores.shape
    half = kernel // 2
    out = torch.empty_like(scores)
    for h in range(heads):
        for t in range(tokens):
            out[h, t] = scores[h, max(0, t - half):min(tokens, t + half + 1)].max()
    return out


@SETTINGS
@given(heads=st.integers(1, 4), tokens=st.integers(1, 40), kernel=st.sampled_from([1, 3, 5, 7]),
       seed=st.integers(0, 10_000))
def test_pool_scores_is_a_centred_max_pool(heads, tokens, kernel, seed):
    scores = torch.rand(heads, tokens, generator=_gen(seed))
    got = kernels.pool_scores(scores, kernel)
    assert got.shape == scores.shape
    torch.testing.assert_close(got, naive_pool(scores, kernel), rtol=0, atol=0)


def test_pool_scores_kernel_5_spreads_a_peak_two_each_way():
    scores = torch.zeros(1, 11)
    scores[0, 5] = 1.0
    got = kernels.pool_scores(scores, 5)
    assert got[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]


@SETTINGS
@given(heads=st.integers(1, 4), tokens=st.integers(1, 30), data=st.data(), decay=st.floats(0.0, 1.0),
       seed=st.integers(0, 10_000))
def test_global_score_merge_matches_definition(heads, tokens, data, decay, seed):
    num_previous = data.draw(st.integers(0, tokens))
    gen = _gen(seed)
    current = torch.rand(heads, tokens, generator=gen)
    previous = 2 * torch.rand(heads, tokens, generator=gen)
    before = current.clone()
    got = kernels.global_score_merge(current, previous, num_previous, decay)
    want = current.clone()
    for h in range(heads):
        for t in range(num_previous):
            want[h, t] = max(float(current[h, t]), decay * float(previous[h, t]))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(current, before), "the current scores must not be modified in place"


# ------------------------------------------------------------------------------------------
# Redundancy


def naive_redundancy_sums(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """keys [T, D] of one head -> [T] raw redundancy (before the softmax), the R-KV way:
    cos = cosine similarity matrix with the diagonal excluded. Every key m names its most recent
    near-duplicate r(m) = max{n != m : cos(m, n) > threshold}, and its similarity to r(m) is spared:
    redundancy(j) = sum over m != j with r(m) != j of cos(m, j).
    (Of a run of duplicates the newest, named by all the others, ends up looking unique.)"""
    tokens = keys.shape[0]
    unit = [keys[t].double() / keys[t].double().norm() if float(keys[t].norm()) > 0 else keys[t].double() * 0
            for t in range(tokens)]
    cos = [[float(unit[m] @ unit[n]) if m != n else 0.0 for n in range(tokens)] for m in range(tokens)]
    recent = []
    for m in range(tokens):
        near = [n for n in range(tokens) if n != m and cos[m][n] > threshold]
        recent.append(max(near) if near else None)
    out = torch.zeros(tokens, dtype=torch.float64)
    for j in range(tokens):
        out[j] = sum(cos[m][j] for m in range(tokens) if m != j and recent[m] != j)
    return out


def naive_redundancy(keys: torch.Tensor, block: int | None, threshold: float, temperature: float) -> torch.Tensor:
    """keys [KH, T, D] -> [KH, T]: raw sums (whole sequence, or separately inside each block of
    `block` tokens for lightning), then a softmax over all T tokens of sums / (T * temperature)."""
    kv_heads, tokens, _ = keys.shape
    out = torch.empty(kv_heads, tokens, dtype=torch.float64)
    for h in range(kv_heads):
        if block is None:
            sums = naive_redundancy_sums(keys[h], threshold)
        else:
            sums = torch.cat([naive_redundancy_sums(keys[h, s:s + block], threshold)
                              for s in range(0, tokens, block)])
        out[h] = torch.softmax(sums / (tokens * temperature), dim=0)
    return out


def clustered_keys(kv_heads: int, tokens: int, head_dim: int, clusters: int, noise: float, seed: int):
    """Keys drawn around a few directions, so near-duplicates (cos > 0.5) are common."""
    gen = _gen(seed)
    centres = torch.randn(kv_heads, clusters, head_dim, generator=gen)
    which = torch.randint(0, clusters, (kv_heads, tokens), generator=gen)
    base = torch.gather(centres, 1, which[..., None].expand(-1, -1, head_dim))
    return base + noise * torch.randn(kv_heads, tokens, head_dim, generator=gen)


@SETTINGS
@given(kv_heads=st.integers(1, 3), tokens=st.integers(2, 24), clusters=st.integers(1, 5),
       noise=st.sampled_from([0.05, 0.5, 2.0]), temperature=st.sampled_from([0.4, 1.0, 0.05]),
       seed=st.integers(0, 10_000))
def test_raw_redundancy_matches_definition(kv_heads, tokens, clusters, noise, temperature, seed):
    keys = clustered_keys(kv_heads, tokens, 8, clusters, noise, seed)
    got = kernels.redundancy_score(keys, None, 0.5, temperature)
    want = naive_redundancy(keys, None, 0.5, temperature)
    assert got.shape == (kv_heads, tokens)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_redundancy_spares_the_newest_of_a_run_of_duplicates():
    """Three copies of one key among orthogonal others: the newest copy looks least redundant."""
    keys = torch.zeros(1, 6, 6)
    for t in range(6):
        keys[0, t, t] = 1.0  # orthogonal
    keys[0, 1] = keys[0, 3] = keys[0, 5] = torch.tensor([0, 0, 0, 0, 0, 1.0])
    got = kernels.redundancy_score(keys, None, 0.5, 1.0)[0]
    # r(1) = r(3) = 5 and r(5) = 3: key 1 is counted by 3 and 5, key 3 by 1 only, key 5 by nobody.
    sums = naive_redundancy_sums(keys[0], 0.5)
    assert sums.tolist() == [0.0, 2.0, 0.0, 1.0, 0.0, 0.0]
    assert float(got[5]) < float(got[3]) < float(got[1])
    torch.testing.assert_close(got.double(), torch.softmax(sums / 6.0, dim=0), rtol=1e-5, atol=1e-7)


@SETTINGS
@given(kv_heads=st.integers(1, 3), tokens=st.integers(1, 40), block=st.sampled_from([2, 4, 8, 16]),
       clusters=st.integers(1, 4), noise=st.sampled_from([0.05, 0.5]), seed=st.integers(0, 10_000))
def test_lightning_redundancy_is_raw_redundancy_within_each_block(kv_heads, tokens, block, clusters, noise, seed):
    keys = clustered_keys(kv_heads, tokens, 8, clusters, noise, seed)
    got = kernels.redundancy_score(keys, block, 0.5, 0.4)
    want = naive_redundancy(keys, block, 0.5, 0.4)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    if block >= tokens:  # one block holds everything: lightning and raw agree
        torch.testing.assert_close(got, kernels.redundancy_score(keys, None, 0.5, 0.4), rtol=1e-5, atol=1e-7)


def test_lightning_ignores_similarity_across_blocks():
    """Copies of one key spread over two blocks are redundant for raw, not for lightning."""
    keys = torch.zeros(1, 8, 8)
    for t in range(8):
        keys[0, t, t] = 1.0
    keys[0, 5] = keys[0, 6] = keys[0, 1]
    # Raw: r(1) = r(5) = 6, r(6) = 5, so key 1 is counted by 5 and 6. Lightning (blocks of 4): key 1
    # is alone in its block, and the pair 5, 6 spare each other.
    raw = naive_redundancy_sums(keys[0], 0.5)
    assert raw.tolist()[1] == 2.0
    light = kernels.redundancy_score(keys, 4, 0.5, 1.0)
    assert torch.allclose(light, torch.full_like(light, 1 / 8))  # all sums zero: uniform
    assert not torch.allclose(kernels.redundancy_score(keys, None, 0.5, 1.0), light)


# ------------------------------------------------------------------------------------------
# Selection


@SETTINGS
@given(heads=st.integers(1, 4), tokens=st.integers(1, 64), data=st.data(), seed=st.integers(0, 10_000))
def test_keep_indices_is_the_top_k_in_ascending_order(heads, tokens, data, seed):
    keep = data.draw(st.integers(1, tokens))
    gen = _gen(seed)
    # Distinct scores (a random permutation) so the top-k set is unique; a few forced to +inf.
    scores = torch.stack([torch.randperm(tokens, generator=gen).float() for _ in range(heads)])
    forced = data.draw(st.integers(0, keep))
    scores[:, tokens - forced:] = float("inf")
    got = kernels.keep_indices(scores, keep)
    assert got.shape == (heads, keep)
    for h in range(heads):
        ranked = sorted(range(tokens), key=lambda t: -float(scores[h, t]))
        want = sorted(ranked[:keep])
        assert got[h].tolist() == want
        assert set(range(tokens - forced, tokens)) <= set(got[h].tolist())


# ------------------------------------------------------------------------------------------
# Compaction


@SETTINGS
@given(num_blocks=st.integers(3, 10), block_size=st.sampled_from([4, 8, 16]), kv_heads=st.integers(1, 4),
       data=st.data(), with_scores=st.booleans(), seed=st.integers(0, 10_000))
def test_compact_kv_moves_exactly_the_selected_entries(num_blocks, block_size, kv_heads, data, with_scores, seed):
    gen = _gen(seed)
    head_dim = 4
    slots = num_blocks * block_size
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    score_cache = torch.rand(slots, kv_heads, generator=gen)
    # Source blocks: a request's table; targets: some of them (overlap) and maybe other blocks.
    source_blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=2, max_size=num_blocks,
                                       unique=True))
    num_targets = data.draw(st.integers(1, len(source_blocks) - 1))
    pool = data.draw(st.permutations(list(range(num_blocks))))
    overlap = data.draw(st.booleans())
    others = [b for b in pool if b not in source_blocks]
    targets = source_blocks[:num_targets] if overlap else (others + source_blocks[::-1])[:num_targets]
    keep = num_targets * block_size
    source_slots = [b * block_size + o for b in source_blocks for o in range(block_size)]
    src = torch.stack([
        torch.tensor(sorted(torch.randperm(len(source_slots), generator=gen)[:keep].tolist()))
        for _ in range(kv_heads)])
    src_slots = torch.tensor(source_slots)[src]  # [kv_heads, keep], each head its own set
    dst_slots = torch.tensor([b * block_size + o for b in targets for o in range(block_size)])
    kept_scores = torch.rand(kv_heads, keep, generator=gen) if with_scores else None

    k_flat0 = k_cache.reshape(slots, kv_heads, head_dim).clone()
    v_flat0 = v_cache.reshape(slots, kv_heads, head_dim).clone()
    scores0 = score_cache.clone()
    # The direct gather, made before anything moves.
    want_k = [k_flat0[src_slots[h], h].clone() for h in range(kv_heads)]
    want_v = [v_flat0[src_slots[h], h].clone() for h in range(kv_heads)]

    kernels.compact_kv(k_cache, v_cache, score_cache if with_scores else None, src_slots, dst_slots, kept_scores)

    k_flat = k_cache.reshape(slots, kv_heads, head_dim)
    v_flat = v_cache.reshape(slots, kv_heads, head_dim)
    for h in range(kv_heads):
        assert torch.equal(k_flat[dst_slots, h], want_k[h])
        assert torch.equal(v_flat[dst_slots, h], want_v[h])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[dst_slots] = False
    assert torch.equal(k_flat[untouched], k_flat0[untouched])
    assert torch.equal(v_flat[untouched], v_flat0[untouched])
    if with_scores:
        assert torch.equal(score_cache[dst_slots], kept_scores.t())
        assert torch.equal(score_cache[untouched], scores0[untouched])
    else:
        assert torch.equal(score_cache, scores0)


def test_compact_kv_in_place_shift_reads_before_writing():
    """Keeping the last `keep` entries of a block table whose first blocks are the targets is a shift
    onto overlapping slots: a serial copy would read already-overwritten entries."""
    block_size, kv_heads = 4, 2
    k = torch.arange(3 * block_size * kv_heads, dtype=torch.float32).reshape(3, block_size, kv_heads, 1)
    v = -k.clone()
    src = torch.arange(2, 2 + 2 * block_size).expand(kv_heads, -1)  # slots 2..9
    dst = torch.arange(0, 2 * block_size)  # slots 0..7
    before_k = k.reshape(-1, kv_heads, 1).clone()
    kernels.compact_kv(k, v, None, src, dst, None)
    assert torch.equal(k.reshape(-1, kv_heads, 1)[:8], before_k[2:10])
    assert torch.equal(v.reshape(-1, kv_heads, 1)[:8], -before_k[2:10])
    assert torch.equal(k.reshape(-1, kv_heads, 1)[8:], before_k[8:])


def test_naive_references_are_not_vacuous():
    """The oracles above must detect a wrong kernel: a softmax without the causal mask, a pooling
    with the wrong kernel, redundancy without sparing."""
    gen = _gen(9)
    keys = torch.randn(12, 1, 4, generator=gen)
    queries = torch.randn(4, 2, 4, generator=gen)
    want = naive_window_score(queries, keys, 0.5)
    cache, table = paged_keys(keys, 4, seed=1)
    no_mask = torch.softmax(torch.einsum("wgd,td->gwt", queries[:, :, :], keys[:, 0]) * 0.5, -1).amax(0).mean(0)
    assert not torch.allclose(no_mask.double(), want[0], atol=1e-4)
    scores = torch.rand(2, 20, generator=gen)
    assert not torch.equal(naive_pool(scores, 5), naive_pool(scores, 3))
    ck = clustered_keys(1, 12, 8, 2, 0.05, 5)
    spared = naive_redundancy_sums(ck[0], 0.5)
    unit = torch.nn.functional.normalize(ck[0].double(), dim=-1)
    plain = (unit @ unit.t()).fill_diagonal_(0).sum(0)
    assert not torch.allclose(spared, plain)
    assert math.isfinite(float(spared.sum()))
