"""Random inputs shared by the tests and the benchmark scripts: tiny models saved as Hugging Face
folders, and shuffled paged KV caches. Nothing here is used when serving."""

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
