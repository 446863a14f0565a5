"""PyTorch versions of every kernel: the CPU backend and the oracle the Triton kernels are tested against.

Cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset. Block tables are int32 [batch, max_blocks], padded with -1.
"""

from __future__ import annotations

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [tokens, kv_heads, head_dim] into their slots; a slot of -1 is skipped."""
    kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` entries of one sequence, in logical order: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:length]


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence against its paged context.

    query [batch, q_heads, head_dim]; context_lens [batch] (KV entries, the new token's included).
    Returns [batch, q_heads, head_dim] in the query's dtype.
    """
    batch, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    valid_block = table >= 0
    table = table.clamp(min=0)
    # [batch, tokens, kv_heads, head_dim]
    keys = k_cache[table].flatten(1, 2).float()
    values = v_cache[table].flatten(1, 2).float()
    q = query.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,btkd->bkgt", q, keys) * scale
    positions = torch.arange(keys.shape[1], device=query.device)
    mask = positions[None, :] < context_lens[:, None].to(positions.device)
    mask &= valid_block.repeat_interleave(block_size, dim=1)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, values)
    return out.reshape(batch, q_heads, head_dim).to(query.dtype)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
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
        q = query[cu[i]:cu[i + 1]]
        num_q = q.shape[0]
        if num_q == 0:
            continue
        keys = gather_kv(k_cache, block_tables[i], kv_len)
        values = gather_kv(v_cache, block_tables[i], kv_len)
        # Query j sits at KV index kv_len - num_q + j and sees every entry up to it.
        q_index = torch.arange(kv_len - num_q, kv_len, device=query.device)
        k_index = torch.arange(kv_len, device=query.device)
        allowed = k_index[None, :] <= q_index[:, None]
        # [heads, tokens, dim] layout for SDPA; K/V heads repeated for the GQA groups.
        qh = q.transpose(0, 1)
        kh = keys.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
        vh = values.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
        out[cu[i]:cu[i + 1]] = o.transpose(0, 1)
    return out


def store_queries(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """Copy queries [tokens, q_heads, head_dim] of window positions into query-cache rows; -1 skips."""
    keep = query_slot_mapping >= 0
    if not bool(keep.any()):
        return
    query_cache.index_copy_(0, query_slot_mapping[keep].long(), query[keep].to(query_cache.dtype))
