"""Float16 weight copies for the CPU's matrix products (docs/design-notes.md, "Quantized CPU weights").

FBGEMM's float16 product keeps a weight as float16, packed in its own blocked layout, and computes
in float32 from float32 activations to float32 outputs: half the bytes of a float32 copy, and on a
2-core AVX2 EPYC faster than oneDNN's packed float32 at every row count measured (1 to 512). A
quantized file's values (an fp16 scale times a small integer code, plus an fp16 offset) round to
float16 within 2**-11 of themselves, far inside the quantization's own error. FBGEMM is x86 only, so
whether this torch runs it is checked, not assumed (`half_product_works`).
"""

from __future__ import annotations

import functools

import torch

FLOAT16_MAX = torch.finfo(torch.float16).max


class HalfWeight(torch.nn.Module):
    """y = x @ W.T with W held as packed float16 (float32 arithmetic, float32 output). `nbytes`: what
    the packed copy holds (it is no tensor, so parameters() and buffers() do not count it)."""

    def __init__(self, values: torch.Tensor):
        super().__init__()
        self.packed = torch.ops.quantized.linear_prepack_fp16(values.detach().float().contiguous(), None)
        self.nbytes = values.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), self.packed)
        return out.to(x.dtype)


def fits_float16(values: torch.Tensor) -> bool:
    """Whether every value is finite and within float16's range (FBGEMM would clamp the rest)."""
    return bool(values.detach().abs().max() <= FLOAT16_MAX)


@functools.cache
def half_product_works() -> bool:
    """Whether this torch has FBGEMM's float16 product and it agrees with the float32 product of the
    float16-rounded weight (an internal op: checked, not assumed)."""
    if not hasattr(torch.ops.quantized, "linear_prepack_fp16"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=gen)
        x = torch.randn(5, 64, generator=gen)
        want = x @ weight.half().float().T
        return bool((HalfWeight(weight)(x) - want).abs().max() <= 1e-4 * want.abs().max())
    except Exception:  # noqa: BLE001 - any failure means: float32 copies instead
        return False
