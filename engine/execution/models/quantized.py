"""GGUF weights that stay quantized on the CPU (docs/design-notes.md, "Quantized CPU weights").

Q4_0, Q4_1, Q4_K, Q5_0, Q6_K and Q8_0 (groups of 32 codes with a float16 scale, and an offset for 4
bits; Q5_0's codes as 8-bit ones, Q6_K's as 8-bit ones with a scale per 16, the K-quants' scales
rounded to float16) run on the native kernels (`zipage.kernels.cpu`, "integer dots"): the codes as
stored times activations quantized to int16 per 32 values, summed in integer units (with AVX-512:
codes decoded to float32 in registers, times the float32 activations), for products of at most
NATIVE_MAX_ROWS rows (LAYER_MAX_ROWS for a decode step's layers and the LM head). Fused parts (q/k/v,
gate/up) of different types run as one product where they share a layout (Q5_0 beside Q8_0, as
llama.cpp's Q4_K_M files mix them), else as a product for each run of same-layout parts
(`NativeParts`). Where no C compiler builds the native kernels, every 4-bit type runs on PyTorch's own int4 CPU kernel,
`_weight_int4pack_mm_for_cpu`, with bf16 activations and bf16 scales-and-zeros (its fp32 path is a scalar loop, ~20x slower), for products of at most
INT4_MAX_ROWS rows. Longer products (prefill chunks, larger batches) and every quantized type without
a kernel run on the weight's float16 copy (`cpu_products.HalfWeight`, FBGEMM), which holds the file's
values within float16 rounding in half the bytes of float32; where this torch has no FBGEMM they run
on a float32 copy. A quantized embedding is looked up from its codes, one decoded row per token.
`install_quantized` gives a model loaded with its float weights the quantized forms (decoded and
packed once, then cached beside the GGUF's converted copy); `WeightReport` says what runs as what,
and why.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from zipage.engine.cpu_products import HalfWeight, fits_float16, half_product_works
from zipage.engine.loading.gguf_tensors import (FOUR_BIT_TYPES, GROUP, GROUPED_TYPES, HALF_ROUNDED_TYPES, NATIVE_BITS,
                                                NATIVE_TYPES, GroupedCodes, QuantizedTensor)
from zipage.engine.loading.loader import c_compiler, cache_dir
from zipage.kernels.cpu.native import OUT_BLOCK, GroupedWeight, NativeLibrary, NativeUnavailable, native_library
from zipage.kernels.cpu.native import LAYOUTS, group_bytes, pack_weight

# The int4 kernel re-decodes the weights for every few rows, so past some rows a float copy wins;
# where, depends on torch's CPU capability. Against oneDNN's packed fp32, on a 2-core AVX2 EPYC int4 won
# up to 4 rows and lost from 5 on (8x at 16 rows); on a 2-core AVX-512 Xeon, over SmolLM2's 30 layers of
# weights, up to 16 rows (28 against 33 ms) and lost at 24 (docs/benchmarks.md, "Quantized weights on
# the CPU"). Against the float16 copy the EPYC's crossover stays between 4 and 5 rows.
INT4_MAX_ROWS_BY_CAPABILITY = {"AVX512": 16}
INT4_MAX_ROWS = INT4_MAX_ROWS_BY_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), 4)


# Integer dots read each weight once for a whole batch, but their integer work grows with the
# rows; on a 2-core AVX2 EPYC, over SmolLM2's 30 layers of weights, they beat the float16 copy up to 4
# rows (11.3 against 13.8 ms) and lost from 5 (14.5 against 13.9; docs/benchmarks.md, "Native CPU
# kernels"), and so did the 49k-row head (2.2 against 2.8 ms at 4 rows, 3.2 against 3.2 at 6).
NATIVE_MAX_ROWS = 4
# A decode step of up to LAYER_MAX_ROWS rows still runs each layer as one native call (fewer Python
# calls win on the whole step: models/native_layer.py), and the LM head takes integer dots up to the
# same rows, so that a decode step's tokens come from one form of the weights whether 1 or 8 requests
# run (docs/design-notes.md, "What output does not depend on, and what it may").
LAYER_MAX_ROWS = 8


def cpu_forms_stamp() -> str:
    """What a quantized file's numbers on the CPU depend on beyond its values: which products run on
    which kernel and the float copies' dtype (a cache of results computed on them keys by it)."""
    library = native_kernel()[0]
    native = (f"integer dots ({library.vector_path}) for {', '.join(NATIVE_TYPES)}" if library is not None
              else "no integer dots")
    return (f"{native} up to {NATIVE_MAX_ROWS} rows ({LAYER_MAX_ROWS} for decode layers and the head), "
            f"int4 up to {INT4_MAX_ROWS} rows, "
            f"{'float16' if half_product_works() else 'float32'} copies")


def native_kernel() -> tuple[NativeLibrary | None, str | None]:
    """The native kernels (built on first use into the cache), or None and why not."""
    try:
        return native_library(cache_dir() / "native", c_compiler()), None
    except NativeUnavailable as error:
        return None, str(error)


class NativeWeight(nn.Module):
    """A linear layer's weight as the native kernels hold it (`pack_weight`): y = x @ W.T from int16
    activations and the file's codes. `takes(x)`: whether it should (x has at most NATIVE_MAX_ROWS rows)."""

    def __init__(self, library: NativeLibrary, blocks: torch.Tensor, bits: int, head: bool = False):
        super().__init__()
        self.library = library
        self.weight = GroupedWeight(blocks, bits)  # checked once; the buffer below is the same tensor
        self.register_buffer("blocks", self.weight.blocks)
        self.head = head  # the LM head: takes up to LAYER_MAX_ROWS rows, as a decode step's layers do

    def takes(self, x: torch.Tensor) -> bool:
        # the limits are read at each call: a benchmark may change them
        return x.shape[0] <= (LAYER_MAX_ROWS if self.head else NATIVE_MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.library.linear(x.float().contiguous(), self.weight, torch.get_num_threads())
        return out.to(x.dtype)


class NativeParts(nn.Module):
    """Fused parts (q/k/v, gate/up) in different native layouts (Q4_K's q and k beside a Q6_K v, as
    llama.cpp's Q4_K_M files have them): a product for each run of neighbours sharing a layout (q and
    k together, v alone), their outputs side by side."""

    def __init__(self, parts: list[NativeWeight]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def takes(self, x: torch.Tensor) -> bool:
        return self.parts[0].takes(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class Int4Weight(nn.Module):
    """A linear layer's weight in PyTorch's int4 CPU layout (`pack_int4`): y = x @ W.T, computed in bf16.
    `takes(x)`: whether it should (x has at most INT4_MAX_ROWS rows)."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.shape[0] <= INT4_MAX_ROWS  # read at each call: a benchmark may change it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, GROUP,
                                                        self.scales_zeros)
        return out.to(x.dtype)


class QuantizedLinear(nn.Module):
    """A weight from a quantized file: its short form (`short`: integer dots or int4) for the products it
    takes, its float16 copy (`copy`) for the rest. Without a copy (no FBGEMM) it takes only what the
    short form takes, and the layer's own float32 weight runs the rest."""

    def __init__(self, short: NativeWeight | Int4Weight | None, copy: HalfWeight | None):
        super().__init__()
        self.short = short
        self.copy = copy

    def takes(self, x: torch.Tensor) -> bool:
        return self.copy is not None or (self.short is not None and self.short.takes(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.short is not None and self.short.takes(x):
            return self.short(x)
        return self.copy(x)


def pack_int4(groups: GroupedCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, bf16 scales-and-zeros): `Int4Weight`'s two tensors. The packed layout depends on
    the CPU's vector width (AVX2 and AVX-512 differ), so a cached copy is keyed by it."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 1)
    # The kernel computes (code - 8) * scale + zero; GGUF's w = code * scale + low, so zero = low + 8 * scale.
    scales_zeros = torch.stack([groups.scale, groups.low + 8 * groups.scale], dim=-1)  # [rows, groups, 2]
    return packed, scales_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)


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
        group = codes.shape[1] // self.scale.shape[1]  # 32, or Q6_K's 16
        grouped = codes.view(-1, codes.shape[1] // group, group).float()
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
        return bool((Int4Weight(*pack_int4(groups))(x) - want).abs().max() <= 1e-2 * want.abs().max())
    except Exception:  # noqa: BLE001 - any failure means: dequantize instead
        return False


@dataclass
class WeightReport:
    """How a model's stored weights run: counts of tensors per "stored type -> form"."""

    forms: Counter = field(default_factory=Counter)
    reasons: dict[str, tuple[str, str]] = field(default_factory=dict)  # stored type -> (form, why not int4)
    notes: set[str] = field(default_factory=set)  # why a weight runs without a float16 copy

    def add(self, qtype: str, form: str, reason: str | None = None) -> None:
        self.forms[f"{qtype} -> {form}"] += 1
        if reason:
            self.reasons[qtype] = (form, reason)

    def summary(self) -> str:
        return ", ".join(f"{n} x {form}" for form, n in sorted(self.forms.items()))


def report_weights(report: WeightReport) -> None:
    """Say on stderr which stored types run without a quantized kernel, and why (never silent).
    Q8_0 in a matrix product runs on its float copy by design (see the module docstring), so not reported."""
    for qtype, (form, reason) in report.reasons.items():
        if qtype != "Q8_0":
            print(f"zipage: {qtype} weights run as {form} on the CPU: {reason}", file=sys.stderr)
    for note in sorted(report.notes):
        print(f"zipage: {note}", file=sys.stderr)


@dataclass(frozen=True)
class Kernels:
    """The quantized products this process has: the native kernels' integer dots (None, and `why_native`
    says why) and PyTorch's int4 kernel. `short_form` says which runs a weight."""

    native: NativeLibrary | None
    int4: bool
    why_native: str | None = None

    @classmethod
    def here(cls) -> "Kernels":
        native, why = native_kernel()
        return cls(native, int4_kernel_works(), why)

    def short_form(self, types: set[str], rows: int) -> tuple[str | None, str | None]:
        """For a weight of `rows` output rows stored in these types: "native", "int4" or None, and when
        None why no quantized kernel runs it."""
        # Fused parts (q/k/v, gate/up) of types the integer dots take run there, one product a layout.
        native_bits = {NATIVE_BITS.get(t) for t in types}
        if len(types) > 1 and None in native_bits:
            return None, "the fused parts are stored in different types"
        qtype = "+".join(sorted(types))
        reasons = []
        if None not in native_bits:
            if self.native is None:
                reasons.append("no integer dots here")
            elif rows % OUT_BLOCK:
                reasons.append(f"integer dots need a multiple of {OUT_BLOCK} output rows, not {rows}")
            else:
                return "native", None
        if types <= set(FOUR_BIT_TYPES):
            if not self.int4:
                reasons.append("this torch has no working int4 CPU kernel")
            elif rows % 16:
                reasons.append(f"the int4 kernel needs a multiple of 16 output rows, not {rows}")
            else:
                return "int4", None
        elif types <= {"Q8_0", "Q5_0"}:
            reasons.append(f"PyTorch's int8 kernel takes one scale per row, {qtype} has one per 32 values")
        elif len(types) > 1:
            reasons.append("the fused parts are stored in different types")
        return None, "; ".join(reasons) or f"no CPU kernel for {qtype} blocks"

    def note(self, report: "WeightReport", types: set[str]) -> None:
        """Say why the weights of these stored types that integer dots would run do not (no compiler, a
        failed build), or run on one thread (a compiler without OpenMP)."""
        missed = sorted(types & set(NATIVE_TYPES))
        if self.native is None and missed:
            report.notes.add(f"integer dots are unavailable: {self.why_native}; so {' and '.join(missed)} "
                             "weights run on slower kernels")
        elif self.native is not None and missed and not self.native.threaded:
            report.notes.add("integer dots run on one thread: the C compiler has no OpenMP (set CC to one "
                             "that has, e.g. clang with libomp)")


FORM_NAMES = {"native": "integer dots", "int4": "int4"}


def install_quantized(model, source, map_name) -> WeightReport:
    """Give a model whose float weights are loaded (from its GGUF's converted copy) the quantized forms
    of the GGUF's tensors where a kernel runs them; `map_name(hf_name)` is (parameter, fused part) as the
    model loads them. Decoding and packing the forms is most of what a start-up would add to the float
    one, so they are cached beside that copy, for this CPU and torch."""
    weights = QuantizedWeights.of(source.stored_weights(), model.tied, map_name)
    kernels = Kernels.here()
    planned = weights.planned(model, kernels)
    keys = {key for target, (kind, parts) in planned.items() for key in _form_keys(target, kind, parts)}
    forms = source.cached(f"forms-{torch.backends.cpu.get_cpu_capability().lower()}",
                          f"{CACHE_FORMAT}, torch {torch.__version__}", keys, lambda: weights.forms(planned))
    return weights.install_forms(model, forms, kernels)


EMBEDDING = "model.embed_tokens.weight"
TIED_HEAD = "tied_lm_head"  # a tied head's quantized form, packed from the embedding's codes
CACHE_FORMAT = "zipage quantized forms 4"  # bump when the cached forms change


def _form_keys(target: str, kind: str | None, parts: dict | None = None) -> list[str]:
    """The names of a weight's quantized form: the embedding's codes, scales and offsets, a native
    weight's blocks (each run of same-layout parts' where fused parts differ in layout), else
    Int4Weight's two tensors."""
    if target == EMBEDDING:
        fields = ("codes", "scale", "low")
    elif kind == "native":
        runs = _runs_by_layout(parts)
        fields = ("blocks",) if runs is None else tuple(f"blocks.{'+'.join(run)}" for run in runs)
    else:
        fields = ("packed", "scales_zeros")
    return [f"{target}.{field}" for field in fields]


def _runs_by_layout(parts: dict | None) -> list[list[str]] | None:
    """A fused weight's shards in order, in runs of neighbours that share a native layout (each run is
    then one product: Q4_K q and k together, a Q6_K v on its own), where its parts differ in layout;
    None where they all share one."""
    if not parts or len({NATIVE_BITS[t.qtype] for t in parts.values()}) == 1:
        return None
    in_order = sorted(parts, key=_shard_order)
    return [list(run) for _, run in itertools.groupby(in_order, key=lambda shard: NATIVE_BITS[parts[shard].qtype])]


def _native_blocks(groups: GroupedCodes, round_to_half: bool) -> torch.Tensor:
    """A weight's codes, scales and offsets in the native kernels' layout (8-bit codes have no offset);
    `round_to_half`: scales and offsets that are no float16 values (HALF_ROUNDED_TYPES) are rounded."""
    bits = 4 if groups.codes.dtype == torch.uint8 else 6 if groups.group == 16 else 8
    scale, low = (groups.scale.half().float(), groups.low.half().float()) if round_to_half else (groups.scale, groups.low)
    return pack_weight(groups.codes, scale, low if bits == 4 else None, bits).blocks


class QuantizedWeights:
    """A model's quantized tensors by the parameter they fill: a fused layer (q/k/v, gate/up) runs
    quantized only if its parts share a type. `forms` decodes and packs what runs quantized;
    `install_forms` gives those forms to a model whose float weights are loaded."""

    def __init__(self):
        self.parts: dict[str, dict[str | None, QuantizedTensor]] = {}

    def add(self, target: str, shard: str | None, tensor: QuantizedTensor) -> None:
        self.parts.setdefault(target, {})[shard] = tensor

    @classmethod
    def of(cls, weights, tied: bool, map_name) -> "QuantizedWeights":
        """The quantized tensors of a stream of (HF name, tensor), by the parameter `map_name` gives."""
        found = cls()
        for name, tensor in weights:
            target, shard = map_name(name)
            if isinstance(tensor, QuantizedTensor) and target is not None and not (tied and target == "lm_head.weight"):
                found.add(target, shard, tensor)
        return found

    def install(self, model, store) -> WeightReport:
        """For CausalLM.load_weights, given stored tensors: store each part's dequantized values with
        `store(target, shard, float_tensor)` (the model's checked copy, for long products), then give
        the model the quantized forms."""
        if not self.parts:  # float weights only
            return WeightReport()
        for target, parts in self.parts.items():
            for shard, tensor in parts.items():
                store(target, shard, tensor.dequantize())
        kernels = Kernels.here()
        return self.install_forms(model, self.forms(self.planned(model, kernels)), kernels)

    def planned(self, model, kernels: Kernels) -> dict[str, tuple[str | None, dict[str | None, QuantizedTensor]]]:
        """(kind, parts) of what runs quantized, by the key its forms go under: each weight a kernel
        runs ("native" or "int4"), the embedding where its type is one of 32-value groups (kind None),
        and a tied head that a kernel runs (TIED_HEAD)."""
        planned = {}
        for target, parts in self.parts.items():
            if target == EMBEDDING and parts[None].qtype in GROUPED_TYPES:
                planned[EMBEDDING] = (None, parts)
                kind, _ = kernels.short_form({parts[None].qtype}, parts[None].shape[0])
                if model.tied and kind is not None:
                    planned[TIED_HEAD] = (kind, parts)
            elif target != EMBEDDING:
                kind, _ = self._short_form(parts, kernels)
                if kind is not None:
                    planned[target] = (kind, parts)
        return planned

    @staticmethod
    def forms(planned: dict) -> dict[str, torch.Tensor]:
        """The planned weights decoded and packed: "<key>.blocks" of a native weight (".blocks.<q+k>" of
        each run of same-layout parts where fused parts differ in layout), "<key>.packed" and
        "<key>.scales_zeros" of an int4 one, "<key>.codes", ".scale" and ".low" of the embedding."""
        forms, embedding = {}, None
        for key, (kind, parts) in planned.items():
            if key in (EMBEDDING, TIED_HEAD):  # decoded once for both
                embedding = parts[None].groups() if embedding is None else embedding
                pieces = [(embedding, parts[None].qtype in HALF_ROUNDED_TYPES)]
            else:
                runs = (kind == "native" and _runs_by_layout(parts)) or [sorted(parts, key=_shard_order)]
                # one product a run (all the parts, where they share a layout)
                pieces = [(_concat([parts[s].groups() for s in run]),
                           any(parts[s].qtype in HALF_ROUNDED_TYPES for s in run)) for run in runs]
            if key == EMBEDDING:
                groups = pieces[0][0]
                values = (groups.codes, groups.scale, groups.low)
            elif kind == "native":
                values = tuple(_native_blocks(groups, rounded) for groups, rounded in pieces)
            else:
                values = pack_int4(pieces[0][0])
            forms.update(zip(_form_keys(key, kind, parts), values))
        return forms

    def install_forms(self, model, forms: dict[str, torch.Tensor], kernels: Kernels) -> WeightReport:
        """Give each weight its quantized forms: the native or int4 one from `forms` where a kernel runs
        its type, and a float16 copy of the float values loaded already where FBGEMM runs (the float32
        values are then freed). Returns what runs as what."""
        report = WeightReport()
        dtype = model.model.norm.weight.dtype
        kernels.note(report, {t.qtype for parts in self.parts.values() for t in parts.values()})
        for target, parts in self.parts.items():
            types = {t.qtype for t in parts.values()}
            if target == EMBEDDING:
                self._install_embedding(model, parts[None], forms, kernels, dtype, report)
                continue
            module = model.get_submodule(target.removesuffix(".weight"))
            kind, why = self._short_form(parts, kernels)
            module.quant, form = _quantized_linear(_short_module(kind, target, forms, kernels, parts), module.weight,
                                                   dtype, report)
            if module.quant is not None and module.quant.copy is not None:
                module.weight = None  # the copy holds the same values
            report.add("+".join(sorted(types)), form, why)
        if any(isinstance(m, NativeWeight) for m in model.modules()):
            model.run_natively(kernels.native)  # its norms and decode attention too: the library is loaded
        return report

    @staticmethod
    def _short_form(parts: dict[str | None, QuantizedTensor], kernels: Kernels) -> tuple[str | None, str | None]:
        kind, why = kernels.short_form({t.qtype for t in parts.values()}, sum(t.shape[0] for t in parts.values()))
        if kind == "native" and _runs_by_layout(parts) is not None and any(t.shape[0] % OUT_BLOCK for t in parts.values()):
            return None, f"integer dots need a multiple of {OUT_BLOCK} output rows in each fused part"
        return kind, why

    @staticmethod
    def _install_embedding(model, tensor: QuantizedTensor, forms: dict, kernels: Kernels, dtype,
                           report: WeightReport) -> None:
        values = model.model.embed_tokens.weight.detach()
        if tensor.qtype in GROUPED_TYPES:
            codes = GroupedCodes(*(forms[key] for key in _form_keys(EMBEDDING, None)))
            model.model.embed_tokens = QuantizedEmbedding(codes, dtype)
            report.add(tensor.qtype, "embedding rows")
        else:
            report.add(tensor.qtype, "dequantized embedding", f"no decoder for {tensor.qtype} blocks")
        if not model.tied:
            return
        kind, why = kernels.short_form({tensor.qtype}, tensor.shape[0])  # as `planned` decided
        model.quant_head, form = _quantized_linear(_short_module(kind, TIED_HEAD, forms, kernels), values, dtype, report)
        if model.quant_head is None or model.quant_head.copy is None:
            model.head_weight = values  # the float values, for the products the quantized forms do not take
        report.add(tensor.qtype, f"{form} LM head", why)


def _short_module(kind: str | None, key: str, forms: dict, kernels: Kernels, parts: dict | None = None
                  ) -> nn.Module | None:
    """The module that runs a weight's short products from its cached forms (None: no kernel does)."""
    if kind is None:
        return None
    tensors = [forms[name] for name in _form_keys(key, kind, parts)]
    if kind == "native":
        weights = [NativeWeight(kernels.native, blocks, next(b for b in LAYOUTS if blocks.shape[2] == group_bytes(b)),
                                head=key in (TIED_HEAD, "lm_head.weight")) for blocks in tensors]
        return weights[0] if len(weights) == 1 else NativeParts(weights)
    return Int4Weight(*tensors)


def _quantized_linear(short: nn.Module | None, values: torch.Tensor, dtype: torch.dtype,
                      report: WeightReport) -> tuple[QuantizedLinear | None, str]:
    """One weight's quantized forms and their name: `short` (integer dots or int4) where given, and a float16
    copy of `values` where FBGEMM runs and they fit; without a copy the weight's float `values` run the rest."""
    copy = None
    if not half_product_works():
        report.notes.add("this torch has no FBGEMM float16 product, so longer products run on float32 copies")
    elif not fits_float16(values):
        report.notes.add("a weight with values beyond float16's range runs on its float32 copy")
    else:
        copy = HalfWeight(values)
    rest = "float16" if copy is not None else str(dtype).removeprefix("torch.")
    if short is None and copy is None:
        return None, rest
    name = FORM_NAMES["native" if isinstance(short, (NativeWeight, NativeParts)) else "int4"]
    return QuantizedLinear(short, copy), (f"{name} / {rest}" if short is not None else rest)


def _shard_order(shard: str | None) -> int:
    return "qkv".find(shard) if shard in ("q", "k", "v") else ("gate", "up", None).index(shard)


def _concat(groups: list[GroupedCodes]) -> GroupedCodes:
    """The parts of a fused layer stacked along the output rows, as the float weights are."""
    if len(groups) == 1:
        return groups[0]
    return GroupedCodes(*(torch.cat([getattr(g, f) for g in groups]) for f in ("codes", "scale", "low")))
