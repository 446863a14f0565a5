"""One dispatch seam for every kernel: CUDA tensors go to the Triton version when one is registered,
everything else to the PyTorch reference (the CPU backend and the test oracle)."""

from __future__ import annotations

import functools

import torch

from zipage.kernels import reference

# Decode steps of at most this many rows take the skinny-product path on CUDA
# (engine.models.decoder.skinny_decode; the kernels take up to 16). On the H200 one row through
# folded skinny products ran a Qwen3-0.6B step at 863 tok/s against 676 through cuBLAS, and 8B
# at 201 against 199; with 4 and 16 rows 8B ran at 0.65x of cuBLAS (docs/benchmarks.md), so more
# rows stay with cuBLAS.
SKINNY_MAX_ROWS = 1

# name -> Triton implementation with the reference's signature; filled in by kernels.triton_ops on CUDA.
TRITON_IMPLS: dict[str, object] = {}


def _dispatch(name: str):
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def call(*args, **kwargs):
        impl = TRITON_IMPLS.get(name)
        if impl is not None:
            first = next(a for a in args if isinstance(a, torch.Tensor))
            if first.is_cuda:
                return impl(*args, **kwargs)
        return ref(*args, **kwargs)

    call.dispatched = True
    return call


store_kv = _dispatch("store_kv")
store_queries = _dispatch("store_queries")
paged_decode_attention = _dispatch("paged_decode_attention")
prefill_attention = _dispatch("prefill_attention")
window_attention_score = _dispatch("window_attention_score")
pool_scores = _dispatch("pool_scores")
global_score_merge = _dispatch("global_score_merge")
redundancy_score = _dispatch("redundancy_score")
keep_indices = _dispatch("keep_indices")
compact_kv = _dispatch("compact_kv")
rms_norm = _dispatch("rms_norm")
add_rms_norm = _dispatch("add_rms_norm")
silu_and_mul = _dispatch("silu_and_mul")
qk_norm_rope_store = _dispatch("qk_norm_rope_store")
linear = _dispatch("linear")
norm_linear = _dispatch("norm_linear")
silu_mul_linear = _dispatch("silu_mul_linear")
sample_rows = _dispatch("sample_rows")
gather_kv = _dispatch("gather_kv")
decode_reads = reference.decode_reads  # the CPU decode attention's reads, once per forward

# Every kernel behind the seam, by name: the one list kernels.triton_ops registers from.
DISPATCHED = tuple(name for name, fn in list(globals().items()) if getattr(fn, "dispatched", False))

SKINNY_NAMES = ("linear", "norm_linear", "silu_mul_linear")


def skinny_registered() -> bool:
    """The skinny products (and their fused prologues) have Triton implementations registered."""
    return all(name in TRITON_IMPLS for name in SKINNY_NAMES)


def use_triton() -> list[str]:
    """Register the Triton kernels behind the seam, where Triton and CUDA are usable; the names
    registered (none otherwise: the PyTorch reference path stays)."""
    from zipage.kernels import triton_ops

    return triton_ops.register()
