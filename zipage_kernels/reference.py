"""PyTorch versions of every kernel: the CPU backend and the oracle the Triton kernels are tested against.

Cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset. Block tables are int32 [batch, max_blocks], padded with -1.

An 8-bit cache (docs/design-notes.md, "KV in 8 bits") holds codes, float8_e4m3fn (fp8) or int8,
beside float32 scales k_scales, v_scales [num_blocks, block_size, num_kv_heads], one per entry and KV
head: the entry's value is code * scale. The engine lays them out [num_blocks, num_kv_heads, block_size] in memory (a
transposed view), so one head's scales in a block are contiguous: kernels read them by stride. Every
kernel that reads or writes the cache takes them as keyword arguments; None means a cache in the
model's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric int8 codes: -127..127
CODE_MAX = {torch.float8_e4m3fn: FP8_MAX, torch.int8: INT8_MAX}  # the 8-bit cache dtypes


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes in dtype, float32 scales [...]): each row scaled so its largest
    magnitude is the dtype's CODE_MAX (an all-zero row gets scale 1), divided, clamped and rounded to
    nearest (ties to even; int8 codes are rounded before the cast, which would truncate)."""
    top = CODE_MAX[dtype]
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    codes = (x32 / scales[..., None]).clamp(-top, top)
    if not dtype.is_floating_point:
        codes = codes.round()
    return codes.to(dtype), scales


@functools.lru_cache(maxsize=None)
def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (n a power of 2), float32: a rotation that
    spreads each channel over all of them. Blocks: H_n = [[A, A], [A, -A]] with A = H_(n/2) / sqrt(2)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-2 size, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n ** 0.5).to(device)


def dequantize(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Cache entries as values: codes * scales in float32 for an 8-bit cache, the cache itself otherwise."""
    return cache if scales is None else cache.float() * scales[..., None]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor as uint8 (the CPU has no index_copy_ for float8), any other unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _store_rows(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> None:
    kv_heads, head_dim = cache.shape[-2:]
    if scales is None:
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, x.to(cache.dtype))
        return
    codes, row_scales = quantize_rows(x, cache.dtype)
    _as_bytes(cache).view(-1, kv_heads, head_dim).index_copy_(0, slots, _as_bytes(codes))
    scales[_block_and_offset(scales, slots)] = row_scales


def _block_and_offset(scales: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots as (block, offset) indices into scales: they may be a strided view, which no flat view
    of slots can address."""
    return slots // scales.shape[1], slots % scales.shape[1]


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Write key/value [tokens, kv_heads, head_dim] into their slots; a slot of -1 is skipped. With
    scales (an 8-bit cache) each entry is quantized on its own (quantize_rows)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    _store_rows(key, k_cache, k_scales, slots)
    _store_rows(value, v_cache, v_scales, slots)


PREFILL_QUERY_TILE = 512  # query rows per attention call on the CPU path


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `length` entries of one sequence, in logical order: [length, kv_heads, head_dim]
    (values in float32 when scales are given), cast to `dtype` when one is given."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].long()
    entries = cache[blocks].flatten(0, 1)[:length]
    values = entries if scales is None else dequantize(entries, scales[blocks].flatten(0, 1)[:length])
    return values if dtype is None else values.to(dtype)


@dataclass(frozen=True)
class DecodeReads:
    """What a decode batch reads from the cache, the same in every layer of a forward, so the CPU
    path works it out once (`decode_reads`): the blocks to read (flat, int64; the same number for
    every row) and the additive mask [batch, 1, 1, entries read per row] hiding each row's entries
    past its context or in a hole. Always whole blocks under a mask: SDPA's CPU kernel
    gives the same bits for a row whatever masked blocks trail it, so a sequence's output does not
    depend on what it is batched with; unmasked or cut mid-block, it rounds differently.
    run: (first block, count) when a lone sequence's blocks are one ascending run, as a single
    stream's usually are: the cache is then read in place, a view of the same bytes the gather
    would copy (docs/design-notes.md, "Model")."""

    blocks: torch.Tensor
    mask: torch.Tensor
    run: tuple[int, int] | None = None

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """These whole blocks of one cache tensor (or its scales), in order."""
        if self.run is not None:
            return cache.narrow(0, *self.run)
        return cache.index_select(0, self.blocks)


def decode_reads(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 dtype: torch.dtype = torch.float32) -> DecodeReads:
    """The reads of paged_decode_attention for these tables and lengths (the mask in `dtype`)."""
    batch, width = block_tables.shape
    table = block_tables.long()
    if batch == 1:  # read only the context's blocks
        table = table[:, :-(-int(context_lens[0]) // block_size)]
        width = table.shape[1]
    positions = torch.arange(width * block_size, device=table.device)
    visible = positions[None, :] < context_lens[:, None].to(positions.device)
    visible &= (table >= 0).repeat_interleave(block_size, dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=table.device).masked_fill_(~visible, float("-inf"))
    return DecodeReads(table.clamp(min=0).flatten(), mask[:, None, None, :], _one_run(table))


def _one_run(table: torch.Tensor) -> tuple[int, int] | None:
    """(first, count) when table [1, count] holds ascending consecutive blocks, else None."""
    if table.shape[0] != 1 or table.shape[1] == 0 or table.device.type != "cpu":
        return None
    first = int(table[0, 0])
    if first < 0 or not torch.equal(table[0], torch.arange(first, first + table.shape[1])):
        return None
    return first, table.shape[1]


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None, reads: DecodeReads | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context.

    query [batch, q_heads, head_dim]; context_lens [batch] (KV entries, the new token's included).
    reads: `decode_reads` of these tables and lengths, when the caller has them (one per forward).
    Returns [batch, q_heads, head_dim] in the query's dtype.
    """
    batch, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if reads is None:
        reads = decode_reads(block_tables, context_lens, block_size, query.dtype)
    # [batch, tokens, kv_heads, head_dim], read through the block table
    keys = _read_blocks(k_cache, k_scales, reads).view(batch, -1, kv_heads, head_dim)
    values = _read_blocks(v_cache, v_scales, reads).view(batch, -1, kv_heads, head_dim)
    # The query heads of one KV head are its "query rows": [batch, kv_heads, group, head_dim]
    # against [batch, kv_heads, tokens, head_dim], plain attention with no GQA expansion (on the
    # CPU, SDPA's masked GQA path is several times slower than this). K/V stay strided views of
    # what was read: SDPA's CPU kernel takes them as they are, in half the time of a copy first.
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim),
        keys.transpose(1, 2).to(query.dtype), values.transpose(1, 2).to(query.dtype),
        attn_mask=reads.mask, scale=scale)
    return out.reshape(batch, q_heads, head_dim)


def _read_blocks(cache: torch.Tensor, scales: torch.Tensor | None, reads: DecodeReads) -> torch.Tensor:
    """Whole blocks of the cache, as values."""
    if scales is None:
        return reads.read(cache)
    return dequantize(reads.read(cache), reads.read(scales))


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Variable-length causal attention whose keys are read through the block table, so a cached
    prefix (or earlier chunk) is attended without being recomputed.

    query [total_q, q_heads, head_dim], sequences concatenated; cu_seqlens_q [batch + 1];
    context_lens [batch]: KV entries of each sequence after this chunk was stored. The queries of
    sequence i are its last (cu[i+1] - cu[i]) KV entries.
    """
    q_heads, head_dim = query.shape[1:]
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, kv_len in enumerate(lens):
        num_q = cu[i + 1] - cu[i]
        if num_q == 0:
            continue
        # [heads, tokens, dim] layout for SDPA; K/V heads repeated for the GQA groups.
        kh = gather_kv(k_cache, block_tables[i], kv_len, k_scales).transpose(0, 1).repeat_interleave(group, dim=0)
        vh = gather_kv(v_cache, block_tables[i], kv_len, v_scales).transpose(0, 1).repeat_interleave(group, dim=0)
        kh, vh = kh.to(query.dtype), vh.to(query.dtype)
        # Queries in tiles: the scores of one tile ([heads, tile, keys]) bound the memory of a long
        # prompt, and a tile reads only the keys it can see.
        for start in range(0, num_q, PREFILL_QUERY_TILE):
            stop = min(start + PREFILL_QUERY_TILE, num_q)
            seen = kv_len - num_q + stop  # keys up to the tile's last query
            # Query j sits at KV index kv_len - num_q + j and sees every entry up to it.
            q_index = torch.arange(kv_len - num_q + start, seen, device=query.device)
            allowed = torch.arange(seen, device=query.device)[None, :] <= q_index[:, None]
            qh = query[cu[i] + start:cu[i] + stop].transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh[:, :seen], vh[:, :seen], attn_mask=allowed,
                                                                 scale=scale)
            out[cu[i] + start:cu[i] + stop] = o.transpose(0, 1)
    return out


def store_queries(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """Copy queries [tokens, q_heads, head_dim] of window positions into query-cache rows; -1 skips."""
    keep = query_slot_mapping >= 0
    if not bool(keep.any()):
        return
    query_cache.index_copy_(0, query_slot_mapping[keep].long(), query[keep].to(query_cache.dtype))


# ---------------------------------------------------------------------------------------------
# Compression: scoring, selection and compaction (docs/design-notes.md, "Compression"). Scores are float32 [kv_heads, tokens].


def window_attention_score(window_queries: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           kv_len: int, scale: float, k_scales: torch.Tensor | None = None) -> torch.Tensor:
    """How much the last w queries attend to each cached key of one sequence.

    window_queries [w, q_heads, head_dim] belong to the last w KV entries, oldest first; causal inside
    the window. Softmax over tokens, max over the query heads of each GQA group, mean over the window.
    Returns [kv_heads, kv_len] float32.
    """
    w, q_heads, head_dim = window_queries.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    keys = gather_kv(k_cache, block_table, kv_len, k_scales).float()  # [T, kv_heads, D]
    q = window_queries.float().view(w, kv_heads, group, head_dim)
    logits = torch.einsum("wkgd,tkd->kgwt", q, keys) * scale
    q_index = torch.arange(kv_len - w, kv_len, device=keys.device)
    future = torch.arange(kv_len, device=keys.device)[None, :] > q_index[:, None]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return probs.amax(dim=1).mean(dim=1)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool along tokens (odd kernel, same length) so neighbours of a strong token survive with it."""
    return torch.nn.functional.max_pool1d(scores[:, None, :], kernel, stride=1, padding=kernel // 2)[:, 0, :]


def global_score_merge(current: torch.Tensor, previous: torch.Tensor, num_previous: int,
                       decay: float) -> torch.Tensor:
    """s = max(s_now, decay * s_prev) for the first `num_previous` tokens (those that carry a score
    out of the last compression); later tokens keep s_now."""
    merged = current.clone()
    if num_previous > 0:
        merged[:, :num_previous] = torch.maximum(current[:, :num_previous], decay * previous[:, :num_previous])
    return merged


def redundancy_score(keys: torch.Tensor, lightning_block: int | None, threshold: float,
                     temperature: float) -> torch.Tensor:
    """How much each key repeats the others (R-KV), softmaxed over tokens.

    keys [kv_heads, T, D]. Redundancy of key m = sum over other keys n of cos(m, n), except that for
    each key n the most recent key m that is a near-duplicate of it (cos > threshold) does not count
    it: of a run of duplicates, the newest looks unique and the older ones redundant.
    With `lightning_block`, similarities are taken only inside each block of that many tokens.
    """
    kv_heads, tokens, _ = keys.shape
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    if lightning_block is None:
        sums = _redundancy_sums(unit, threshold)
    else:
        pad = -tokens % lightning_block
        padded = torch.nn.functional.pad(unit, (0, 0, 0, pad))  # zero keys have zero similarity
        blocks = padded.reshape(kv_heads * (padded.shape[1] // lightning_block), lightning_block, -1)
        sums = _redundancy_sums(blocks, threshold).reshape(kv_heads, -1)[:, :tokens]
    return torch.softmax(sums / (tokens * temperature), dim=-1)


def _redundancy_sums(unit: torch.Tensor, threshold: float) -> torch.Tensor:
    """unit [groups, n, D] -> [groups, n]: row sums of cosine similarity with the rules above."""
    n = unit.shape[1]
    sim = unit @ unit.transpose(1, 2)  # [groups, m, n]
    eye = torch.eye(n, dtype=torch.bool, device=unit.device)
    sim = sim.masked_fill(eye, 0.0)
    near = sim > threshold
    rows = torch.arange(n, device=unit.device)[None, :, None]
    latest = torch.where(near, rows, -1).amax(dim=1, keepdim=True)  # newest near-duplicate row per column
    spared = near & (rows == latest)
    return sim.masked_fill(spared, 0.0).sum(dim=-1)


def keep_indices(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` best tokens of each head, in ascending token order: [kv_heads, keep].
    Ascending order keeps kept tokens in their original order after compaction."""
    top = torch.topk(scores, keep, dim=-1).indices
    return torch.sort(top, dim=-1).values


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
               src_slots: torch.Tensor, dst_slots: torch.Tensor, kept_scores: torch.Tensor | None,
               position_cache: torch.Tensor | None = None, choice_cache: torch.Tensor | None = None,
               kept_choices: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> None:
    """Move the kept entries of every KV head into the target slots, all at once.

    src_slots [kv_heads, keep]: the cache slot each head keeps at each position; dst_slots [keep].
    Sources may overlap targets: everything is gathered before anything is written.
    score_cache [slots, kv_heads] (optional) receives kept_scores [kv_heads, keep].
    position_cache [slots, kv_heads] (optional, int32): each entry's token position, moved with its
    entry; choice_cache [slots, kv_heads] (optional) receives kept_choices [kv_heads, keep], the score
    each kept entry was ranked by (docs/design-notes.md, "What a request still holds").
    k_scales, v_scales (an 8-bit cache): each entry's scale moves with its codes; nothing is re-quantized.
    """
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads = torch.arange(kv_heads, device=k_cache.device)[None, :]
    src = src_slots.t().long()  # [keep, kv_heads]
    dst = dst_slots.long()
    flat = [k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)]
    kept = [t[src, heads] for t in flat]  # [keep, kv_heads, D] (copies)
    scales = [t for t in (k_scales, v_scales) if t is not None]
    kept_scales = [t[(*_block_and_offset(t, src), heads)] for t in scales]  # [keep, kv_heads]
    kept_positions = position_cache[src, heads] if position_cache is not None else None
    for t, entries in zip(flat, kept):
        t[dst] = entries
    for t, entries in zip(scales, kept_scales):
        t[_block_and_offset(t, dst)] = entries
    if score_cache is not None and kept_scores is not None:
        score_cache[dst] = kept_scores.t().to(score_cache.dtype)
    if kept_positions is not None:
        position_cache[dst] = kept_positions
    if choice_cache is not None and kept_choices is not None:
        choice_cache[dst] = kept_choices.t().to(choice_cache.dtype)


# ---------------------------------------------------------------------------------------------
# The elementwise chains around the matrix products of a decoder layer. Each is one fused kernel
# on CUDA; here they keep the exact operation order of the Hugging Face models (normalise in fp32,
# scale in the input dtype; RoPE in the input dtype), so the CPU engine matches transformers.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalised in fp32, cast back, then scaled by weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same operations in the same order as below, in one ATen call: in fp32 there is no
        # cast between normalising and scaling, so the result is bit-identical (and ~6 calls fewer).
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * n] holds gate then up: silu(gate) * up, [tokens, n]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def qk_norm_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       query_cache: torch.Tensor | None, query_slot_mapping: torch.Tensor | None,
                       k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                       hadamard_qk: bool = False) -> torch.Tensor:
    """Everything between the QKV projection and attention, for one layer.

    qkv [tokens, (q_heads + 2 * kv_heads) * head_dim] is split into q, k, v; q and k get the per-head
    RMSNorm (when q_norm/k_norm are given, Qwen3) and the rotary embedding (cos, sin: [tokens,
    head_dim] float, each token's rows of the tables); k and v are stored into their cache slots (-1
    skips; quantized when k_scales, v_scales are given) and q into its query-cache row when
    query_slot_mapping is given (-1 skips). hadamard_qk: q and k leave rotated by `hadamard`, which
    leaves every q·k as it was and spreads a key's outlier channels before an int8 cache quantizes it
    (docs/design-notes.md, "KV in 8 bits").
    Returns q [tokens, q_heads, head_dim] in qkv's dtype (a view).
    """
    tokens = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[2:]
    q_heads = qkv.shape[1] // head_dim - 2 * kv_heads
    qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    if q_norm is not None:
        qk = torch.cat((rms_norm(qk[:, :q_heads], q_norm, eps), rms_norm(qk[:, q_heads:], k_norm, eps)), dim=1)
    # q and k heads rotate together: the same elementwise ops on one tensor, half the op count.
    qk = _rotate(qk, cos.to(qkv.dtype)[:, None, :], sin.to(qkv.dtype)[:, None, :])
    if hadamard_qk:
        qk = (qk.float() @ hadamard(head_dim, qk.device)).to(qkv.dtype)
    q, k = qk[:, :q_heads], qk[:, q_heads:]
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if query_slot_mapping is not None:
        store_queries(q, query_cache, query_slot_mapping)
    return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# Projections of a decode step. On CUDA, at most 16 rows run as skinny products with the chain
# before them folded in (kernels.triton_linear); here they are the plain compositions.


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, weight an nn.Linear weight [out, in]."""
    return torch.nn.functional.linear(x, weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a sublayer's input projection and the
    residual stream; without a residual, (linear(rms_norm(x)), x)."""
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, summed = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), summed


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear(silu_and_mul(x)): the MLP's down projection of its gate/up output [tokens, 2 * n]."""
    return linear(silu_and_mul(x), weight, bias)


# ---------------------------------------------------------------------------------------------
# Sampling (docs/design-notes.md, "Sampling")

# Columns of sample_rows' params [rows, 5] (float64): a row without top-k has top_k = vocab, without
# top-p top_p = 1, without min-p min_p = 0; u in [0, 1) is the row's one uniform draw.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "u")


def sample_rows(logits: torch.Tensor, params: torch.Tensor, ranked: torch.Tensor | None,
                asks: tuple[bool, bool, bool, bool]) -> torch.Tensor:
    """One token id per row of logits [rows, vocab] (float32, penalised and masked, not yet divided
    by the temperature): of the row's filtered_rows softmaxed, the first token whose cumulative
    probability (float64, vocabulary order) exceeds u times the row's total."""
    return inverse_cdf(filtered_rows(logits, params, ranked, asks).softmax(-1), params[:, 4])


def filtered_rows(logits: torch.Tensor, params: torch.Tensor, ranked: torch.Tensor | None,
                  asks: tuple[bool, bool, bool, bool]) -> torch.Tensor:
    """Each row's logits / temperature, -inf where its top-k, top-p or min-p drops a token. ranked
    [rows, C]: each row's C largest logits, largest first (C = vocab: the row sorted whole), or None
    when no row filters. asks: whether any filtering row has a top-k, a top-p, a min-p, and whether
    every filtering row has a top-k. Where every filtering row has a top-k of at most C, its kept
    tokens are settled by its candidates; otherwise (only the CPU passes fewer candidates) an
    unsettled row sends the rows to a whole sort."""
    temperature, top_k, top_p, min_p, _ = params.unbind(-1)
    vocab = logits.shape[-1]
    temperature = temperature.to(logits.dtype)[:, None]
    scaled = logits / temperature
    if ranked is None:
        return scaled
    top_k, top_p, min_p = top_k.long(), top_p.to(logits.dtype), min_p.to(logits.dtype)
    filters = (top_k < vocab) | (top_p < 1.0) | (min_p > 0.0)
    threshold, unsettled = sampling_threshold(scaled, ranked / temperature, top_k, top_p, min_p, asks)
    if ranked.shape[-1] < vocab and not asks[3] and bool((unsettled & filters).any()):
        ranked = torch.sort(scaled, descending=True)[0]
        threshold = sampling_threshold(scaled, ranked, top_k, top_p, min_p, asks)[0]
    threshold = threshold.masked_fill(filters.logical_not(), float("-inf"))
    return scaled.masked_fill(scaled < threshold[:, None], float("-inf"))


def sampling_threshold(scaled: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, asks: tuple[bool, bool, bool, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's lowest kept logit and whether the row is unsettled by its candidates.

    Each filter keeps a row's likeliest tokens down to some logit, so together they keep every token
    at or above one threshold: the logit of the last kept candidate, with values [rows, C] the
    row's C largest scaled logits, largest first. top-k keeps ties with the k-th logit; top-p drops a
    token when the strictly likelier ones already reach top_p (so it keeps a tie whole; the first
    token always stays), its probabilities a softmax over what top-k kept of the whole row; min-p
    drops a token less likely than min_p times the most likely one. A row is unsettled when it keeps
    its last candidate and no top-k stops within the candidates: later tokens may be kept too."""
    asks_top_k, asks_top_p, asks_min_p, all_top_k = asks
    vocab, candidates = scaled.shape[-1], values.shape[-1]
    whole = candidates == vocab
    kept = torch.ones_like(values, dtype=torch.bool)
    kth = values.gather(-1, (top_k - 1).clamp(max=candidates - 1)[:, None])
    if asks_top_k:
        kept &= values >= kth
    if asks_top_p:
        ranked = values.masked_fill(kept.logical_not(), float("-inf")) if asks_top_k else values
        if whole or asks_top_k:
            normaliser = ranked.logsumexp(-1, keepdim=True)
        else:  # the candidates against the whole row
            normaliser = scaled.logsumexp(-1, keepdim=True)
        if not whole and asks_top_k:  # against what top-k kept of the whole row
            has_top_k = (top_k < vocab)[:, None]
            # ties with the k-th logit may lie past the candidates: count them in
            past = (scaled == kth).sum(-1, keepdim=True) - (values == kth).sum(-1, keepdim=True)
            normaliser = torch.where(has_top_k, torch.logaddexp(normaliser, kth + past.to(kth.dtype).log()), normaliser)
            if not all_top_k:
                normaliser = torch.where(has_top_k, normaliser, scaled.logsumexp(-1, keepdim=True))
        probs = (ranked - normaliser).exp()
        kept &= (probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)
    if asks_min_p:
        kept &= (values - values[:, :1]).exp() >= min_p[:, None]
    kept[:, 0] = True
    # the kept tokens are a prefix of the ranking: the threshold is the last one's logit
    last = kept.sum(-1, keepdim=True) - 1
    return values.gather(-1, last)[:, 0], kept[:, -1] & (top_k > candidates)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of probs [rows, vocab], the first token whose cumulative probability (float64)
    exceeds uniforms[row] (float64) times the row's total: token i with probability probs[i], never a
    token of probability 0 (the sum does not rise there)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    targets = (uniforms.to(torch.float64) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


# --- Products of grouped integer weights with int16 activations (the CPU's native kernel, kernels/cpu) ---

ACTIVATION_CODE_MAX = 32767.0


def quantize_groups_int16(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows [m, k] quantized per `group` values: (int16 codes, scale = amax / 32767, the quantized
    group's sum = scale * its codes' sum); codes = round(x * (32767 / amax)), ties to even, 0 where a
    group is all zeros."""
    m, k = x.shape
    groups = x.view(m, k // group, group)
    amax = groups.abs().amax(dim=-1)
    inverse = torch.where(amax > 0, ACTIVATION_CODE_MAX / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse[..., None]).to(torch.int16)
    scale = amax / ACTIVATION_CODE_MAX
    return codes.view(m, k), scale, codes.sum(dim=-1, dtype=torch.int32).float() * scale


def grouped_int16_matmul(values: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, xq: torch.Tensor,
                        xs: torch.Tensor, xsum: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x @ W.T in float64, for W = values * scale + low in groups of `group` (values [n, k] integers; scale
    [n, k / group], or a scale per part of a group: Q6_K's per 16 values) and x = xq * xs per group with
    group sums xsum: sum over groups of scale * xs * (values . xq) + low * xsum."""
    n, k = values.shape
    part = k // scale.shape[1]  # values per weight scale
    w = values.double().view(n, k // part, part)
    x = xq.double().view(xq.shape[0], k // part, part)
    dots = torch.einsum("ngj,mgj->mng", w, x)  # exact integer sums in float64
    xs = xs.double().repeat_interleave(group // part, dim=1)
    return (dots * scale.double()[None] * xs[:, None]).sum(-1) + xsum.double() @ low.double().T


def grouped_matmul(values: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, x: torch.Tensor,
                   group: int = 32) -> torch.Tensor:
    """x @ W.T in float64 for W = values * scale + low in groups of `group` and float rows x: the
    product the AVX-512 build computes from the decoded weights."""
    n, k = values.shape
    w = values.double().view(n, k // group, group) * scale.double()[..., None] + low.double()[..., None]
    return x.double() @ w.view(n, k).T
