"""One decoder for the Llama, Qwen2 and Qwen3 families, with fused QKV and gate/up projections.

Family differences are switches read from the Hugging Face config: QKV bias (Qwen2),
per-head q/k RMSNorm (Qwen3), tied embeddings and RoPE scaling (llama3) where the config says so.
Attention reads and writes the paged KV cache through `kernels`. Under tensor parallelism
(`engine.models.parallel`) each rank builds the same classes with its share of the heads, MLP
columns and vocabulary, and loads or draws exactly that share of the full weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from zipage import kernels
from zipage.engine.execution.models.parallel import TensorParallel
from zipage.engine.execution.models.quantized import QuantizedWeights, WeightReport
from zipage.engine.loading.gguf_tensors import QuantizedTensor
from zipage.kernels.cpu.native import CACHE_KINDS as NATIVE_CACHE_DTYPES

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass
class ForwardBatch:
    """What attention needs to know about one forward pass over a flat list of tokens."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [tokens] cache slot of each token's K/V
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, -1 padded
    context_lens: torch.Tensor  # [seqs] KV entries after this step's tokens are stored
    cu_seqlens_q: torch.Tensor | None = None  # [seqs + 1] prefill only
    # A mixed step: the first num_decode sequences decode one token each (their queries come first),
    # the others are prefill chunks. Each part runs its own attention kernel.
    num_decode: int = 0
    # Query cache (compression): queries of window positions are copied to these slots, -1 = none
    query_slot_mapping: torch.Tensor | None = None
    query_cache: list[torch.Tensor] = field(default_factory=list)  # per layer [slots * window, q_heads, dim]

    def __post_init__(self):
        # The chunks' own offsets, tables and lengths, made once per forward rather than in every
        # layer, as fresh tensors: a view at offset num_decode would change the pointers' alignment
        # from step to step, and Triton compiles a variant per alignment.
        self.chunk_cu_seqlens = self.chunk_block_tables = self.chunk_context_lens = None
        self._decode_reads: dict | None = None
        self._native_tables: tuple | None = None
        if self.num_decode:
            nd = self.num_decode
            self.chunk_cu_seqlens = self.cu_seqlens_q[nd:] - nd
            self.chunk_block_tables = self.block_tables[nd:].clone()
            self.chunk_context_lens = self.context_lens[nd:].clone()

    def decode_reads(self, k_cache: torch.Tensor, dtype: torch.dtype) -> dict:
        """{"reads": ...} for the CPU decode attention of this forward's decoding sequences (the
        blocks and mask every layer reads alike, worked out by the first layer); {} on CUDA, whose
        kernels read the tables themselves."""
        if k_cache.is_cuda:
            return {}
        if self._decode_reads is None:
            rows = self.num_decode or self.block_tables.shape[0]
            self._decode_reads = {"reads": kernels.decode_reads(self.block_tables[:rows], self.context_lens[:rows],
                                                                k_cache.shape[1], dtype)}
        return self._decode_reads


    def native_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(slots int64, block tables int32, context lengths int32, query slots int64 or None) as the
        native CPU library reads them, contiguous, made once per forward for all its layers."""
        if self._native_tables is None:
            query_slots = None
            if self.query_slot_mapping is not None and self.query_cache:
                query_slots = self.query_slot_mapping.to(torch.int64).contiguous()
            self._native_tables = (self.slot_mapping.to(torch.int64).contiguous(),
                                   self.block_tables.to(torch.int32).contiguous(),
                                   self.context_lens.to(torch.int32).contiguous(), query_slots)
        return self._native_tables


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked for oneDNN's CPU matrix products (`pack_for_cpu`):
    in fp32 a blocked layout runs the small-batch products of decode 1.5-2.5x faster than the
    plain row-major weight. Packing frees the plain weight; the layer then computes from the packed one."""

    packed: torch.Tensor | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quant: nn.Module | None = None  # a weight kept quantized on the CPU (models/quantized.py)

    def pack_for_cpu(self) -> None:
        self.packed = pack_weight(self.weight.detach())
        self.weight = None  # the packed copy holds the same values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and self.quant.takes(x):
            out = self.quant(x)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def cpu_packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build has oneDNN's packed linear for `dtype` and it agrees with F.linear
    (an internal ATen op: checked, not assumed)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        out = packed_linear(x, pack_weight(w), b)
        return torch.allclose(out.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
    except Exception:  # noqa: BLE001 - any failure means: keep the plain path
        return False


class RMSNorm(nn.Module):
    """RMSNorm through the kernel seam, or through the native CPU library (`native`, set for a model
    that runs its quantized weights there: one call where torch's CPU rms_norm is several operators)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = None  # NativeLibrary (zipage.kernels.cpu.native), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and _plain_rows(x):
            return self.native.rms_norm(x, self.weight, self.eps)[0]
        return kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel on CUDA (and natively on a quantized CPU model)."""
        if self.native is not None and _plain_rows(x) and _plain_rows(residual):
            return self.native.rms_norm(x, self.weight, self.eps, residual)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def _plain_rows(x: torch.Tensor) -> bool:
    """Contiguous float32 rows on the CPU: what the native library takes."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


class RotaryEmbedding(nn.Module):
    """cos/sin tables over every position up to `length`, in float32 whatever the model's dtype;
    a forward gathers its tokens' rows once and every layer reads them."""

    def __init__(self, hf_config, head_dim: int):
        super().__init__()
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
                                        / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported RoPE type {rope_type!r}")
            with torch.device("cpu"):  # real values even when the model is built on the meta device
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        # Plain attributes, not buffers: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)
        self.length = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 4096
        self._table: torch.Tensor | None = None  # [length, 2 (cos, sin), head_dim]

    def set_length(self, length: int) -> None:
        """Cover positions below `length` (the engine's max_model_len), no more."""
        if length != self.length:
            self.length = length
            self._table = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of these positions, each [tokens, head_dim] float32 (one gather a forward;
        the two halves repeat the frequencies). The table is built once per device."""
        if self._table is None or self._table.device != positions.device:
            steps = torch.arange(self.length, device=positions.device, dtype=torch.int64).float()
            freqs = steps[:, None] * self.inv_freq.to(positions.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._table = torch.stack((emb.cos() * self.scaling, emb.sin() * self.scaling), dim=1)
        rows = self._table[positions]  # [tokens, 2, head_dim]
        return rows[:, 0], rows[:, 1]


class Attention(nn.Module):
    def __init__(self, cfg, layer_index: int, tp: TensorParallel):
        super().__init__()
        self.layer_index = layer_index
        self.tp = tp
        self.num_heads = tp.share(cfg.num_attention_heads, "attention heads")  # this rank's heads
        self.num_kv_heads = tp.share(cfg.num_key_value_heads, "KV heads")
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = family_of(cfg) == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size,
                                bias=bool(getattr(cfg, "attention_bias", False)) and family_of(cfg) == "llama")
        self.qk_norm = family_of(cfg) == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # an 8-bit cache's scales as the kernels take them, by keyword; empty for a cache in the model's
        # dtype (docs/design-notes.md, "KV in 8 bits")
        self.cache_scales: dict[str, torch.Tensor] = {}
        # {"hadamard_qk": True} when q and k are rotated before an int8 cache stores k (same note)
        self.qk_rotation: dict[str, bool] = {}
        self.native = None  # NativeLibrary for RoPE, stores and decode attention (CausalLM.run_natively), or None

    def forward(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(self.attend(self.qkv_proj(hidden), cos_sin, batch)))

    def attend(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
               batch: ForwardBatch) -> torch.Tensor:
        """Everything between the QKV and O projections: [tokens, q_size] from qkv [tokens, qkv width]."""
        tokens = qkv.shape[0]
        store_queries = batch.query_slot_mapping is not None and bool(batch.query_cache)
        scales = self.cache_scales
        query_cache = batch.query_cache[self.layer_index] if store_queries else None
        query_slots = batch.query_slot_mapping if store_queries else None
        if self.runs_natively(qkv) and not self.qk_norm:
            q = self.native.rope_store(qkv, *cos_sin, self.k_cache, self.v_cache, batch.slot_mapping, query_cache,
                                       query_slots, **scales, **self.qk_rotation)
        else:
            q = kernels.qk_norm_rope_store(
                qkv, *cos_sin,
                self.q_norm.weight if self.qk_norm else None, self.k_norm.weight if self.qk_norm else None,
                self.q_norm.eps if self.qk_norm else 0.0, self.k_cache, self.v_cache, batch.slot_mapping,
                query_cache, query_slots, **scales, **self.qk_rotation)
        if batch.num_decode:  # a mixed step: decode attention for the decoders, prefill for the chunks
            nd = batch.num_decode
            out = torch.cat([
                self._decode_attention(q[:nd], batch.block_tables[:nd], batch.context_lens[:nd], batch),
                kernels.prefill_attention(q[nd:], self.k_cache, self.v_cache, batch.chunk_block_tables,
                                          batch.chunk_cu_seqlens, batch.chunk_context_lens, self.scale, **scales)])
        elif batch.is_prefill:
            out = kernels.prefill_attention(q, self.k_cache, self.v_cache, batch.block_tables,
                                            batch.cu_seqlens_q, batch.context_lens, self.scale, **scales)
        else:
            out = self._decode_attention(q, batch.block_tables, batch.context_lens, batch)
        return out.reshape(tokens, self.q_size)

    def runs_natively(self, x: torch.Tensor) -> bool:
        """Whether this layer's attention runs on the native CPU library: a model run there, float32
        activations, and a float32 cache or an 8-bit one (its codes and scales read and written there)."""
        return self.native is not None and x.dtype == torch.float32 and self.k_cache.dtype in NATIVE_CACHE_DTYPES

    def _decode_attention(self, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                          batch: ForwardBatch) -> torch.Tensor:
        """One query per sequence against its paged context: natively for a model that runs on the native
        CPU library (runs_natively), else through the kernel seam."""
        if self.runs_natively(q):
            return self.native.decode_attention(q.contiguous(), self.k_cache, self.v_cache, block_tables,
                                                context_lens, self.scale, torch.get_num_threads(), **self.cache_scales)
        return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, block_tables, context_lens, self.scale,
                                              **self.cache_scales, **batch.decode_reads(self.k_cache, q.dtype))


class MLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.intermediate = tp.share(cfg.intermediate_size, "intermediate size")
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)
        self.native = None  # NativeLibrary for SiLU-and-multiply (CausalLM.run_natively), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native is not None and _plain_rows(gate_up):
            hidden = self.native.silu_and_mul(gate_up)
        else:
            hidden = kernels.silu_and_mul(gate_up)
        return self.tp.all_reduce(self.down_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_index: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(cfg, layer_index, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.native = None  # NativeDecodeLayer (models/native_layer.py; CausalLM.run_natively), or None

    def forward(self, hidden, residual, cos_sin, batch, skinny: bool = False, warmer=None):
        """The residual stream travels beside the sublayer outputs, so each residual add fuses
        with the norm after it: returns (this layer's MLP output, the stream before adding it).
        skinny: the small-batch decode path (see `skinny_decode`), its weights warmed in L2 by
        `warmer` where one is given (kernels.triton_linear.weight_warmer)."""
        if skinny:
            return self._forward_skinny(hidden, residual, cos_sin, batch, warmer)
        if self.native is not None and self.native.takes(hidden, batch):
            return self.native(hidden, residual, cos_sin, batch)  # the whole layer in one native call
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
        normed, residual = self.post_attention_layernorm.add(
            self.self_attn(normed, cos_sin, batch), residual)
        return self.mlp(normed), residual

    def _forward_skinny(self, hidden, residual, cos_sin, batch, warmer=None):
        """The same layer with skinny products, in the order of `product_weights`. Where
        kernels.triton_linear folds the prologues, each norm (and residual add) runs in the prologue
        of the projection after it and SiLU-and-multiply in the down projection's: five launches
        besides attention's (eight to ten on the plain path)."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        warm_next = warmer.before_product if warmer is not None else (lambda: None)
        warm_next()
        qkv, residual = kernels.norm_linear(hidden, residual, norm1.weight, norm1.eps,
                                            attn.qkv_proj.weight, attn.qkv_proj.bias)
        attended = attn.attend(qkv, cos_sin, batch)
        warm_next()
        out = kernels.linear(attended, attn.o_proj.weight, attn.o_proj.bias)
        warm_next()
        gate_up, residual = kernels.norm_linear(out, residual, norm2.weight, norm2.eps,
                                                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        warm_next()
        return kernels.silu_mul_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias), residual

    def product_weights(self) -> list[torch.Tensor]:
        """The weights of the skinny path's products, in the order it runs them."""
        attn, mlp = self.self_attn, self.mlp
        return [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]


def skinny_decode(hidden: torch.Tensor, batch: ForwardBatch, tp: TensorParallel) -> bool:
    """Whether this forward takes the small-batch decode path: a decode step of at most
    kernels.SKINNY_MAX_ROWS tokens on CUDA, on one rank, with the Triton skinny products registered.
    There a step streams the weights once, and its products run as skinny Triton kernels (which
    can also absorb the norms and SiLU-and-multiply). Prefill, the CPU and tensor parallelism
    keep the plain chains (cuBLAS or oneDNN products)."""
    return (not batch.is_prefill and hidden.is_cuda and not tp.enabled
            and hidden.shape[0] <= kernels.SKINNY_MAX_ROWS and kernels.skinny_registered())


class DecoderBody(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, vocab_rows: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus LM head. `forward` returns final hidden states; `logits` projects chosen rows."""

    def __init__(self, hf_config, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.family = family_of(hf_config)
        self.config = hf_config
        self.tp = tp
        # Each rank holds an equal slice of the vocabulary, the last one zero-padded.
        self.vocab_rows = -(-hf_config.vocab_size // tp.size)
        self.model = DecoderBody(hf_config, tp, self.vocab_rows)
        self.rope = RotaryEmbedding(hf_config, head_dim_of(hf_config))
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._packed_head: torch.Tensor | None = None  # a tied head's packed copy (pack_for_cpu)
        # A tied head when the embedding stays quantized (models/quantized.py): its int4 form for short
        # products where the embedding's type has one, and a float16 copy, else its own float32 values.
        self.quant_head: nn.Module | None = None
        self.head_weight: torch.Tensor | None = None
        self.weight_report = WeightReport()  # what of a quantized file runs quantized
        if not self.tied:
            self.lm_head = Linear(hf_config.hidden_size, self.vocab_rows, bias=False)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self._embed(input_ids), None
        cos_sin = self.rope.cos_sin(positions)
        skinny = skinny_decode(hidden, batch, self.tp)
        warmer = None
        if skinny:
            from zipage.kernels import triton_linear

            warmer = triton_linear.weight_warmer(w for layer in self.model.layers for w in layer.product_weights())
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos_sin, batch, skinny, warmer)
        if warmer is not None:
            warmer.join()
        return self.model.norm.add(hidden, residual)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self.model.embed_tokens(input_ids)
        # Vocab-parallel: a rank embeds the ids in its slice and zeros elsewhere; the sum is exact.
        local = input_ids - self.tp.rank * self.vocab_rows
        inside = (local >= 0) & (local < self.vocab_rows)
        hidden = self.model.embed_tokens(local.clamp(0, self.vocab_rows - 1))
        return self.tp.all_reduce(hidden * inside[:, None].to(hidden.dtype))

    def pack_for_cpu(self) -> bool:
        """Repack every projection and the LM head of an fp32 CPU model for oneDNN (see Linear);
        False when the model is not one or this torch cannot. The embedding stays plain for
        lookups, so a tied head gets its own packed copy."""
        dtype = self.model.norm.weight.dtype
        # fp32 only: bf16 products already go through oneDNN (AMX where the CPU has it), and
        # packing measured slower there at 16 rows.
        if (self.model.norm.weight.device.type != "cpu" or dtype != torch.float32
                or not cpu_packing_works(dtype)):
            return False
        for module in self.modules():
            # A weight with a float16 copy (models/quantized.py) has no float32 values left to pack.
            if isinstance(module, Linear) and module.packed is None and module.weight is not None:
                module.pack_for_cpu()
        if self.tied and getattr(self.quant_head, "copy", None) is None and self._tied_head_weight() is not None:
            self._packed_head = pack_weight(self._tied_head_weight().detach())
            self.head_weight = None  # the packed copy holds the same values
        return True

    def run_natively(self, library) -> None:
        """Run every RMSNorm, SiLU-and-multiply, and RoPE, cache stores and decode attention over a float32
        cache on the native CPU library, and each layer whose projections all run integer dots as one
        call a decode step (docs/design-notes.md, "Native CPU kernels")."""
        from zipage.engine.execution.models.native_layer import NativeDecodeLayer

        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.native = library
        for layer in self.model.layers:  # and a decode step's whole layer, where all of it runs there
            layer.native = NativeDecodeLayer(layer, library) if NativeDecodeLayer.fits(layer) else None

    def _tied_head_weight(self) -> torch.Tensor | None:
        """A tied head's float values: its own copy, else the embedding's (None when the embedding is
        kept as codes and the head as a float16 copy)."""
        if self.head_weight is not None:
            return self.head_weight
        return getattr(self.model.embed_tokens, "weight", None)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of these rows; written into `out` (same shape) when given."""
        if self.quant_head is not None and self.quant_head.takes(hidden):
            logits = self.quant_head(hidden)
        elif self._packed_head is not None:
            logits = packed_linear(hidden, self._packed_head, None)
        elif self.tied:
            logits = F.linear(hidden, self._tied_head_weight())
        else:
            logits = self.lm_head(hidden)
        if self.tp.enabled:
            logits = self.tp.gather_columns(logits.float())[:, :self.config.vocab_size]
        if out is not None:
            return out.copy_(logits)
        return logits.float()

    # -- weights -----------------------------------------------------------------
    def init_random(self, seed: int) -> None:
        """Random weights for the `random:` presets: small normal init, unit norms. Drawn on the
        parameters' own device, so an 8B model never passes through host memory."""
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        std = float(getattr(self.config, "initializer_range", 0.02))
        full_shapes = None
        if self.tp.enabled:  # draw each full tensor as one rank would, then keep this rank's share
            with torch.device("meta"):
                full_shapes = {n: p.shape for n, p in CausalLM(self.config).named_parameters()}
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                elif full_shapes is None:
                    param.normal_(0.0, std, generator=gen)
                else:
                    full = torch.empty(full_shapes[name], dtype=param.dtype, device=device)
                    param.copy_(self._local_part(name, None, full.normal_(0.0, std, generator=gen)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up into their packed layers.
        Quantized tensors (a GGUF read as stored, on one CPU rank) are kept quantized where a
        kernel runs them, else dequantized (`weight_report` says which)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        quantized = QuantizedWeights()

        def store(target: str, shard: str | None, tensor: torch.Tensor, name: str | None = None) -> None:
            param = params[target]
            tensor = self._local_part(target, shard, tensor)
            with torch.no_grad():
                if shard is None:
                    _copy_checked(param, tensor, name or target)
                else:
                    _copy_checked(param.narrow(0, *self._shard_range(target, shard)), tensor, name or target)

        for name, tensor in weights:
            target, shard = map_name(name)
            if target is None:
                continue
            if self.tied and target == "lm_head.weight":
                continue
            if target not in params:
                raise ValueError(f"weight {name!r} does not fit a {self.family} model of this shape")
            if isinstance(tensor, QuantizedTensor):
                if self.tp.enabled:
                    raise ValueError("quantized weights run on one CPU rank only")
                rows = params[target].shape[0] if shard is None else self._shard_range(target, shard)[1]
                expected = (rows, *params[target].shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {expected}")
                quantized.add(target, shard, tensor)  # installed once every part of a fused layer is in
            else:
                store(target, shard, tensor, name)
            loaded.add(f"{target}#{shard}" if shard else target)
        missing = [n for n in self._expected_names() if n not in loaded]
        if missing:
            raise ValueError(f"model file is missing {len(missing)} weights, e.g. {missing[:3]}")
        self.weight_report = quantized.install(self, store)

    def _local_part(self, target: str, shard: str | None, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor of parameter `target` (or of its fused part `shard`)."""
        tp = self.tp
        if not tp.enabled:
            return full
        if shard is not None:  # q, k, v, gate or up: a column-parallel slice of output rows
            return tp.take(full, 0)
        if "qkv_proj" in target:  # the whole fused [q; k; v]
            attn = self.attention_layers[0]
            q, k, v = full.split([attn.q_size * tp.size, attn.kv_size * tp.size, attn.kv_size * tp.size])
            return torch.cat([tp.take(q), tp.take(k), tp.take(v)])
        if "gate_up_proj" in target:
            gate, up = full.chunk(2)
            return torch.cat([tp.take(gate), tp.take(up)])
        if target.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: input columns
            return tp.take(full, 1)
        if target.endswith("o_proj.bias"):  # added once, before the all-reduce sums the ranks
            return full if tp.rank == 0 else torch.zeros_like(full)
        if target in ("model.embed_tokens.weight", "lm_head.weight"):
            return tp.take_padded_rows(full, self.vocab_rows)
        return full

    def _shard_range(self, target: str, shard: str) -> tuple[int, int]:
        attn = self.attention_layers[0]
        if "qkv_proj" in target:
            starts = {"q": (0, attn.q_size), "k": (attn.q_size, attn.kv_size),
                      "v": (attn.q_size + attn.kv_size, attn.kv_size)}
            return starts[shard]
        inter = self.model.layers[0].mlp.intermediate
        return {"gate": (0, inter), "up": (inter, inter)}[shard]

    def _expected_names(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if "qkv_proj" in name:
                names += [f"{name}#{s}" for s in "qkv"]
            elif "gate_up_proj" in name:
                names += [f"{name}#gate", f"{name}#up"]
            else:
                names.append(name)
        return names


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    if not tensor.is_floating_point():  # integer weights (a quantized or broken file) would be cast silently
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; expected floating-point weights")
    param.copy_(tensor.to(param.dtype))
    if not torch.isfinite(param).all():  # checked after the cast: a value can also overflow the dtype
        raise ValueError(f"weight {name!r} holds NaN or infinite values: the model file is corrupt")


def map_name(name: str) -> tuple[str | None, str | None]:
    """HF parameter name -> (our parameter name, shard of a fused layer or None)."""
    if "rotary_emb" in name:
        return None, None
    for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        if f".self_attn.{proj}." in name:
            return name.replace(f".{proj}.", ".qkv_proj."), shard
    for proj, shard in (("gate_proj", "gate"), ("up_proj", "up")):
        if f".mlp.{proj}." in name:
            return name.replace(f".{proj}.", ".gate_up_proj."), shard
    return name, None


def family_of(hf_config) -> str:
    family = getattr(hf_config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unsupported model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    return family


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
