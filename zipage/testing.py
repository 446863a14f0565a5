"""Random inputs shared by the tests and the benchmark scripts: tiny models saved as Hugging Face
folders or GGUF files, and shuffled paged KV caches. Nothing here is used when serving."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_model(folder: Path | str, family: str = "llama-tiny", seed: int = 0, init: float = 0.2,
                      vary_norms: bool = True, chat_template: str | None = None):
    """A transformers model of the `random:<family>` preset's shape with seeded random weights, saved
    with the preset's byte tokenizer as an HF folder (safetensors). Weights ~N(0, init); with
    `vary_norms`, norm weights around 1 and non-zero biases too, so every model switch matters.
    `chat_template`: the tokenizer's template instead of the preset's. Returns the model (float32, eval
    mode)."""
    from transformers import AutoModelForCausalLM

    from zipage.engine.loading.loader import resolve_model

    source = resolve_model(f"random:{family}")
    config = source.hf_config
    config.initializer_range = init
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if vary_norms:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
                elif name.endswith(".bias"):
                    param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    if chat_template is not None:
        source.tokenizer.chat_template = chat_template
    source.tokenizer.save_pretrained(folder)
    return model


def random_paged_cache(lens, block_size: int, kv_heads: int, head_dim: int, gen: torch.Generator, *,
                       spare_blocks: int = 3, extra_cols: int = 2, ahead=None, randn=None):
    """Random K and V caches `[blocks, block_size, kv_heads, head_dim]` and shuffled block tables for
    sequences of these lengths, padded with -1 (`extra_cols` beyond the longest); `ahead[i]` more
    blocks are allocated past length i. `randn(shape)` draws the caches (default: float32 CPU from
    `gen`); the tables are int32 on the CPU."""
    ahead = ahead or [0] * len(lens)
    if len(ahead) != len(lens):  # zip would leave the later sequences without blocks
        raise ValueError(f"ahead gives {len(ahead)} counts for {len(lens)} sequences")
    counts = [max(1, -(-n // block_size)) + a for n, a in zip(lens, ahead)]
    num_blocks = sum(counts) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    draw = randn or (lambda s: torch.randn(s, generator=gen))
    k_cache, v_cache = draw(shape), draw(shape)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(counts) + extra_cols), -1, dtype=torch.int32)
    used = 0
    for i, c in enumerate(counts):
        tables[i, :c] = perm[used:used + c].int()
        used += c
    return k_cache, v_cache, tables


def gguf_names(config) -> dict[str, tuple[int, int] | int]:
    """The GGUF tensors of a model of this (transformers) config: name -> shape (rows, cols) of a
    matrix, or length of a norm or bias."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    names = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": hidden}
    if not config.tie_word_embeddings:
        names["output.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        names.update({f"blk.{i}.attn_q.weight": (q, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                      f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, q),
                      f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                      f"blk.{i}.ffn_down.weight": (hidden, inter),
                      f"blk.{i}.attn_norm.weight": hidden, f"blk.{i}.ffn_norm.weight": hidden})
        if config.model_type == "qwen3":
            names.update({f"blk.{i}.attn_q_norm.weight": head_dim, f"blk.{i}.attn_k_norm.weight": head_dim})
        if config.model_type == "qwen2":  # q/k/v biases
            names.update({f"blk.{i}.attn_q.bias": q, f"blk.{i}.attn_k.bias": kv, f"blk.{i}.attn_v.bias": kv})
    return names


# Bytes of a 256-value super-block, and where its float16 scales go: Q4_K's d and dmin first, Q6_K's
# d last; the values keep random weights of about the size write_gguf's others have.
K_QUANT_BLOCKS = {"Q4_K": (144, {0: 6e-4, 2: 3e-4}), "Q6_K": (210, {208: 1.3e-4})}


def k_quant_blocks(qtype: str, rows: int, cols: int, rng):
    """Random Q4_K or Q6_K blocks [rows, bytes per row] (cols a multiple of 256) with sane scales."""
    import numpy as np

    size, scales = K_QUANT_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at, value in scales.items():
        blocks[..., at:at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(config, qtype: str, seed: int, only: dict | None = None, embedding: str = "Q8_0",
               types: dict[str, str] | None = None) -> str:
    """A GGUF file of random weights in `qtype` (the embedding in `embedding`, the tensors `types` names
    in theirs; norms around 1) for a model of this config, in a temp file; `only`: these tensors
    (name -> float32 array) instead."""
    import tempfile

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    path = tempfile.mkstemp(suffix=".gguf")[1]
    writer = GGUFWriter(path, arch=config.model_type)
    rng = np.random.default_rng(seed)
    tensors = only or {}
    if only is None:
        for name, shape in gguf_names(config).items():
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32) if isinstance(shape, int) \
                else (rng.standard_normal(shape) * 0.15).astype(np.float32)
    for name, values in tensors.items():
        kind = (types or {}).get(name, embedding if name == "token_embd.weight" else qtype)
        if values.ndim == 1:
            writer.add_tensor(name, values)
        elif kind in K_QUANT_BLOCKS:  # the gguf package cannot quantize to these: random blocks instead
            writer.add_tensor(name, k_quant_blocks(kind, *values.shape, rng), raw_dtype=GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, quants.quantize(values, GGMLQuantizationType[kind]),
                              raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_source(config, path: str):
    """The GGUF file as the engine sees one (a ModelSource with the byte tokenizer): dequantized to
    float32 unless read quantized."""
    from zipage.engine.loading.gguf_tensors import QuantizedTensor, read_gguf_tensors
    from zipage.engine.loading.loader import ModelSource
    from zipage.engine.loading.model_registry import byte_tokenizer

    def dequantized():
        for name, tensor in read_gguf_tensors(path, config):
            yield name, tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor

    return ModelSource("random-gguf", config, byte_tokenizer(), path, dequantized)
