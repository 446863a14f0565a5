"""A decoder layer's decode step in one native call (docs/design-notes.md, "Native CPU kernels").

A model whose weights run integer dots runs each operator of its layers in the native library, each
one Python call; on a one-row step those calls, not arithmetic, were most of the layer's time. This
runs the whole layer (norm, QKV product, RoPE and stores, decode attention, O product, norm, gate/up,
SiLU, down) in one: the same C functions in the same order, so the same bits as the operator-by-
operator path, which still runs whatever this does not take (prefill and mixed steps, more rows than
integer dots take, a layer with Qwen3's q/k norms).
"""

from __future__ import annotations

import ctypes

import torch

from zipage.engine.execution.models import quantized
from zipage.engine.execution.models.quantized import NativeWeight
from zipage.kernels.cpu.native import CACHE_KINDS, LayerArgs, NativeLibrary


class NativeDecodeLayer:
    """`layer` (a DecoderLayer) as one native call for decode steps: `takes(hidden, batch)` says when."""

    def __init__(self, layer, library: NativeLibrary):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.library = layer, library
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.biases = [p.bias.detach().float().contiguous() if p.bias is not None else None for p in projections]
        weights = [p.quant.short.weight for p in projections]
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.args = LayerArgs(
            hidden=norm1.weight.shape[0], q_heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=mlp.intermediate, norm1=norm1.weight.data_ptr(),
            norm2=norm2.weight.data_ptr(), eps=norm1.eps, scale=attn.scale,
            weights=(ctypes.c_void_p * 4)(*(w.blocks.data_ptr() for w in weights)),
            bits=(ctypes.c_int * 4)(*(w.bits for w in weights)),
            biases=(ctypes.c_void_p * 4)(*(b.data_ptr() if b is not None else None for b in self.biases)))
        self._held = (weights, norm1.weight, norm2.weight)  # what the pointers point into

    @staticmethod
    def fits(layer) -> bool:
        """Whether the layer's four projections run integer dots and its attention has no q/k norms."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return not attn.qk_norm and layer.input_layernorm.eps == layer.post_attention_layernorm.eps and all(
            p.quant is not None and isinstance(p.quant.short, NativeWeight) for p in projections)

    def takes(self, hidden: torch.Tensor, batch) -> bool:
        """A decode-only step of at most LAYER_MAX_ROWS float32 rows over a cache the library takes."""
        attn = self.layer.self_attn
        return (not batch.is_prefill and not batch.num_decode and hidden.shape[0] <= quantized.LAYER_MAX_ROWS
                and hidden.dtype == torch.float32 and hidden.is_contiguous() and attn.runs_natively(hidden))

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin, batch):
        attn, args = self.layer.self_attn, self.args
        cos, sin = cos_sin
        slots, tables, lengths, query_slots = batch.native_tables()
        query_cache = batch.query_cache[attn.layer_index] if query_slots is not None else None
        rows = hidden.shape[0]
        if cos.stride(-1) != 1 or sin.stride() != cos.stride() or cos.shape != (rows, attn.head_dim) or \
                slots.shape != (rows,) or tables.shape[0] != rows or lengths.shape != (rows,) or \
                (query_cache is not None and (not query_cache.is_contiguous() or query_slots.shape != (rows,))):
            raise ValueError(f"a decode step of {rows} rows whose tables do not match it")
        args.rows, args.threads = rows, torch.get_num_threads()
        args.cos, args.sin, args.table_stride = cos.data_ptr(), sin.data_ptr(), cos.stride(0)
        args.k_cache, args.v_cache = attn.k_cache.data_ptr(), attn.v_cache.data_ptr()
        scales = attn.cache_scales  # (the engine's layouts, which cache_kind describes)
        args.kind = CACHE_KINDS[attn.k_cache.dtype]
        args.k_scales = scales["k_scales"].data_ptr() if scales else None
        args.v_scales = scales["v_scales"].data_ptr() if scales else None
        args.hadamard = int(bool(attn.qk_rotation))
        args.cache_blocks, args.block_size = attn.k_cache.shape[0], attn.k_cache.shape[1]
        args.slots, args.block_tables, args.table_width = slots.data_ptr(), tables.data_ptr(), tables.shape[1]
        args.context_lens = lengths.data_ptr()
        args.query_cache = query_cache.data_ptr() if query_cache is not None else None
        args.query_slots = query_slots.data_ptr() if query_slots is not None else None
        args.query_rows = query_cache.shape[0] if query_cache is not None else 0
        residual = residual.contiguous() if residual is not None else None
        return self.library.decode_layer(args, hidden, residual)
