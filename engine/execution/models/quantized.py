"""GGUF weights that stay quantized on the CPU (docs/design-notes.md, "Quantized CPU weights").

4-bit types (Q4_0, Q4_1, Q4_K: 32 codes 0..15 per scale and offset) run on PyTorch's own int4
CPU kernel, `_weight_int4pack_mm_for_cpu`, with bf16 activations and bf16 scales-and-zeros (its
fp32 path is a scalar loop, ~20x slower), for products of at most INT4_MAX_ROWS rows: a decode
step of a few streams, which streams every weight once. Longer products (prefill chunks, larger
batches) run on the layer's dequantized copy as before, where the int4 kernel measured slower.
A quantized embedding is looked up from its codes, one decoded row per token. Every other type,
and Q8_0 in a matrix product, is dequantized to the model's dtype and runs as before: PyTorch's
int8 kernel takes one scale per row, and requantizing Q8_0's per-32 scales to one per row moved
the LM head's top-1 token on 3.4% of random states.
`QuantizedWeights` collects a model's quantized tensors while it loads and installs them;
`WeightReport` says what runs quantized and what was dequantized, and why.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from zipage.engine.loading.gguf_tensors import FOUR_BIT_TYPES, GROUP, GROUPED_TYPES, GroupedCodes, QuantizedTensor

# The int4 kernel computes 4 rows per pass and re-decodes the weights each pass: on a 2-core AVX2
# CPU it beat oneDNN's packed fp32 product up to 4 rows and lost from 5 on (8x at 16 rows).
INT4_MAX_ROWS = 4


class Int4Weight(nn.Module):
    """A linear layer's weight in PyTorch's int4 CPU layout: y = x @ W.T, computed in bf16.
    `takes(x)`: whether it should (x has at most INT4_MAX_ROWS rows)."""

    def __init__(self, groups: GroupedCodes):
        super().__init__()
        codes = groups.codes.to(torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # The kernel computes (code - 8) * scale + zero; GGUF's w = code * scale + low, so zero = low + 8 * scale.
        scales_zeros = torch.stack([groups.scale, groups.low + 8 * groups.scale], dim=-1)  # [rows, groups, 2]
        self.register_buffer("scales_zeros", scales_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.shape[0] <= INT4_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, GROUP,
                                                        self.scales_zeros)
        return out.to(x.dtype)


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept as their codes: a lookup decodes only the rows of its tokens."""

    def __init__(self, groups: GroupedCodes, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("codes", groups.codes)
        self.register_buffer("scale", groups.scale)
        self.register_buffer("low", groups.low)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[ids]
        grouped = codes.view(-1, codes.shape[1] // GROUP, GROUP).float()
        rows = grouped * self.scale[ids][..., None] + self.low[ids][..., None]
        return rows.view(codes.shape).to(self.dtype)


def int4_kernel_works() -> bool:
    """Whether this torch has the int4 CPU kernel and it agrees with the dequantized product
    (an internal ATen op: checked, not assumed)."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        groups = GroupedCodes(torch.randint(0, 16, (48, 64), generator=gen, dtype=torch.uint8),
                              torch.rand(48, 2, generator=gen) * 0.1, torch.randn(48, 2, generator=gen) * 0.1)
        x = torch.randn(3, 64, generator=gen)
        want = x @ groups.dequantize().T
        return bool((Int4Weight(groups)(x) - want).abs().max() <= 1e-2 * want.abs().max())  # bf16 rounding
    except Exception:  # noqa: BLE001 - any failure means: dequantize instead
        return False


@dataclass
class WeightReport:
    """How a model's stored weights run: counts of tensors per "stored type -> form"."""

    forms: Counter = field(default_factory=Counter)
    reasons: dict[str, str] = field(default_factory=dict)  # stored type -> why it was dequantized

    def add(self, qtype: str, form: str, reason: str | None = None) -> None:
        self.forms[f"{qtype} -> {form}"] += 1
        if reason:
            self.reasons[qtype] = reason

    def summary(self) -> str:
        return ", ".join(f"{n} x {form}" for form, n in sorted(self.forms.items()))


def report_weights(report: WeightReport) -> None:
    """Say on stderr which stored types were dequantized because no kernel runs them (never silent).
    Q8_0 in a matrix product is dequantized by design (see the module docstring), so not reported."""
    for qtype, reason in report.reasons.items():
        if qtype != "Q8_0":
            print(f"zipage: {qtype} weights run dequantized on the CPU: {reason}", file=sys.stderr)


class QuantizedWeights:
    """A model's quantized tensors, gathered while it loads: a fused layer (q/k/v, gate/up) can run
    quantized only once all its parts are in, and only if they share a 4-bit type."""

    def __init__(self):
        self.parts: dict[str, dict[str | None, QuantizedTensor]] = {}

    def add(self, target: str, shard: str | None, tensor: QuantizedTensor) -> None:
        self.parts.setdefault(target, {})[shard] = tensor

    def install(self, model, store) -> WeightReport:
        """Store each target's dequantized values in `model` with `store(target, shard, float_tensor)`
        (the model's own checked copy, for long products), and give it its int4 form where a kernel
        runs its type. Returns what was done."""
        report = WeightReport()
        int4 = int4_kernel_works()
        dtype = model.model.norm.weight.dtype
        for target, parts in self.parts.items():
            types = {t.qtype for t in parts.values()}
            qtype = "+".join(sorted(types))
            if target == "model.embed_tokens.weight":
                self._install_embedding(model, parts[None], int4, dtype, report, store)
                continue
            # Decoded once: the groups give both the float copy (as exact as gguf's own dequantization,
            # and faster) and the int4 form.
            decoded = {shard: t.groups() if t.qtype in GROUPED_TYPES else None for shard, t in parts.items()}
            for shard, tensor in parts.items():
                store(target, shard, tensor.dequantize() if decoded[shard] is None else decoded[shard].dequantize())
            why = _why_not_int4(types, int4, sum(t.shape[0] for t in parts.values()))
            if why is None:
                module = model.get_submodule(target.removesuffix(".weight"))
                module.quant = Int4Weight(_concat([decoded[s] for s in sorted(parts, key=_shard_order)]))
                report.add(qtype, "int4")
            else:
                report.add(qtype, f"dequantized {str(dtype).removeprefix('torch.')}", why)
        return report

    @staticmethod
    def _install_embedding(model, tensor: QuantizedTensor, int4: bool, dtype, report: WeightReport, store) -> None:
        if tensor.qtype not in GROUPED_TYPES:
            store("model.embed_tokens.weight", None, tensor.dequantize())
            report.add(tensor.qtype, "dequantized embedding", f"no decoder for {tensor.qtype} blocks")
            return
        groups = tensor.groups()
        model.model.embed_tokens = QuantizedEmbedding(groups, dtype)
        report.add(tensor.qtype, "embedding rows")
        if not model.tied:
            return
        model.head_weight = groups.dequantize().to(dtype)  # the head's own copy, for long products
        why = _why_not_int4({tensor.qtype}, int4, tensor.shape[0])
        if why is None:
            model.quant_head = Int4Weight(groups)
            report.add(tensor.qtype, "int4 LM head")
        else:
            report.add(tensor.qtype, f"dequantized LM head {str(dtype).removeprefix('torch.')}", why)


def _why_not_int4(types: set[str], int4: bool, rows: int) -> str | None:
    """None when a weight of `rows` output rows stored in these types runs as int4, else why not."""
    if not int4:
        return "this torch has no working int4 CPU kernel"
    if len(types) > 1:
        return "the fused parts are stored in different types"
    (qtype,) = types
    if qtype == "Q8_0":
        return "Q8_0 has a scale per 32 values and PyTorch's int8 kernel one per row (requantizing loses accuracy)"
    if qtype not in FOUR_BIT_TYPES:
        return f"no PyTorch CPU kernel for {qtype} blocks"
    if rows % 16:
        return f"the int4 kernel needs a multiple of 16 output rows, not {rows}"
    return None


def _shard_order(shard: str | None) -> int:
    return "qkv".find(shard) if shard in ("q", "k", "v") else ("gate", "up", None).index(shard)


def _concat(groups: list[GroupedCodes]) -> GroupedCodes:
    """The parts of a fused layer stacked along the output rows, as the float weights are."""
    if len(groups) == 1:
        return groups[0]
    return GroupedCodes(*(torch.cat([getattr(g, f) for g in groups]) for f in ("codes", "scale", "low")))
