"""One dispatch seam for every kernel: CUDA tensors go to Triton when it is available,
everything else to the PyTorch reference (the CPU backend)."""

from __future__ import annotations

from kernels import reference

_TRITON: dict[str, object] = {}  # name -> Triton implementation, filled in by kernels.triton_ops


def _pick(name: str, tensor):
    impl = _TRITON.get(name)
    if impl is not None and tensor.is_cuda:
        return impl
    return getattr(reference, name)


def store_kv(key, value, k_cache, v_cache, slot_mapping):
    return _pick("store_kv", k_cache)(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
    return _pick("paged_decode_attention", query)(query, k_cache, v_cache, block_tables, context_lens, scale)


def prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    return _pick("prefill_attention", query)(query, k_cache, v_cache, block_tables, cu_seqlens_q,
                                             context_lens, scale)


def store_queries(query, query_cache, query_slot_mapping):
    return _pick("store_queries", query_cache)(query, query_cache, query_slot_mapping)
