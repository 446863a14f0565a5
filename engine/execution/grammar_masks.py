"""Token masks of structured output (docs/design-notes.md, "Structured output"): each constrained row's
allowed tokens are written on the host as a bitmask (32 tokens per int32), copied once per step, and
unpacked where the logits are. A step without a constrained row does none of this."""

from __future__ import annotations

import numpy as np
import torch

from zipage.engine.loading.grammars import OutputGrammar


def fill_bitmasks(grammars: list[OutputGrammar], vocab_size: int, pin: bool) -> torch.Tensor:
    """[len(grammars), ceil(vocab_size / 32)] int32 on the host: bit t of a row allows token t."""
    bitmask = torch.empty((len(grammars), (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=pin)
    for row, grammar in enumerate(grammars):
        grammar.fill_mask(bitmask, row)
    return bitmask


def mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """The logits [batch, vocab] with every token a row's bitmask forbids at -inf, in those rows. A new
    tensor: the input stays the raw distribution that log-probabilities report."""
    vocab = logits.shape[-1]
    allowed = _unpack(bitmask, logits.device)
    if allowed.shape[-1] < vocab:  # logits wider than the grammar's vocabulary: the rest is never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    index = torch.tensor(rows, dtype=torch.long)
    if logits.device.type == "cuda":
        index = index.pin_memory().to(logits.device, non_blocking=True)
    masked = logits.index_select(0, index).masked_fill_(~allowed[:, :vocab], float("-inf"))
    return logits.index_copy(0, index, masked)


def _unpack(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    return unpack_on_host(bitmask) if device.type == "cpu" else unpack_on_device(bitmask, device)


def unpack_on_host(bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, 32 * words] bool: bit b of word w (little-endian) is token 32 w + b. One C pass over the bits."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits).bool()


def unpack_on_device(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The same, unpacked on `device` from the copied words (shifts of each word by 0..31)."""
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
