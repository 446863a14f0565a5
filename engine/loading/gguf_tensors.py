"""A GGUF file's tensors as they are stored: quantized blocks stay blocks.

`read_gguf_tensors(path, hf_config)` yields (Hugging Face name, tensor) like the dequantizing
loader, but every quantized tensor comes as a `QuantizedTensor` (its raw block bytes, row by
row) for the CPU's quantized kernels (docs/design-notes.md, "Quantized CPU weights").
`QuantizedTensor.groups()` decodes the block layouts that are groups of 32 integer codes with
one scale and one offset each (w = code * scale + low): Q4_0, Q4_1, Q4_K, Q5_0 and Q8_0, and Q6_K's
groups of 16 with a scale each. Every other type is only dequantized.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

if TYPE_CHECKING:  # torch loads only to read weights: `zipage models` reads headers without it
    import torch

GROUP = 32  # values per scale in every type `groups()` decodes
FLOAT_TYPES = ("F32", "F16", "BF16")
GROUPED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # codes 0..15
# The types the CPU's integer dots take, by their layout there (zipage.kernels.cpu.native.LAYOUTS):
# groups of 32 codes with a float16 scale (and a float16 offset for 4 bits). Q5_0's codes, -16..15,
# are 8-bit ones, exactly; Q6_K's, -32..31, are 8-bit codes with a scale per 16 (layout 6).
NATIVE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q8_0": 8, "Q6_K": 6}
NATIVE_TYPES = tuple(NATIVE_BITS)
# The K-quants' scales and offsets are products (a float16 times a 6- or 8-bit integer), so their
# integer dots hold them rounded to float16, as the float16 copy holds every value (docs/design-notes.md).
HALF_ROUNDED_TYPES = ("Q4_K", "Q6_K")


@dataclass(frozen=True)
class GroupedCodes:
    """A weight as integer codes in groups of 32 (Q6_K: 16) along each row: w = codes * scale + low."""

    codes: torch.Tensor  # [rows, cols] uint8 (4-bit types, 0..15) or int8 (Q5_0, Q6_K, Q8_0)
    scale: torch.Tensor  # [rows, cols // group] float32
    low: torch.Tensor  # [rows, cols // group] float32

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // self.group, self.group).float()
        return (grouped * self.scale[..., None] + self.low[..., None]).view(rows, cols)


@dataclass
class QuantizedTensor:
    """One quantized GGUF tensor: `shape` (rows, cols) as PyTorch sees it, `blocks` the bytes of
    each row (uint8 [rows, bytes per row]), `qtype` the GGML type name (Q4_1, Q6_K, ...)."""

    qtype: str
    shape: tuple[int, int]
    blocks: np.ndarray

    def dequantize(self) -> torch.Tensor:
        """float32 values, exactly as the gguf package (and so transformers' loader) gives them."""
        import torch
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(np.ascontiguousarray(self.blocks), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)

    def groups(self) -> GroupedCodes:
        """The codes, scales and offsets of a tensor of a GROUPED_TYPES type (ValueError otherwise)."""
        import torch

        if self.qtype not in GROUPED_TYPES:
            raise ValueError(f"{self.qtype} is not a type of 32-value groups ({', '.join(GROUPED_TYPES)})")
        rows, cols = self.shape
        raw = np.ascontiguousarray(self.blocks).reshape(rows, -1)
        codes, scale, low = _DECODERS[self.qtype](raw, rows)
        group = 16 if self.qtype == "Q6_K" else GROUP
        return GroupedCodes(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
                            torch.from_numpy(scale.reshape(rows, cols // group).astype(np.float32)),
                            torch.from_numpy(low.reshape(rows, cols // group).astype(np.float32)))

    def take_rows(self, order: np.ndarray) -> "QuantizedTensor":
        """The same tensor with its rows in `order` (a row is whole blocks, so this is exact)."""
        return QuantizedTensor(self.qtype, self.shape, self.blocks[order])


def _half(raw: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32: [rows, blocks]."""
    return raw[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes of a 32-value group -> 32 codes: low nibbles are values 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(raw, rows):
    blocks = raw.reshape(rows, -1, 18)  # fp16 d, 16 bytes of codes; w = (q - 8) * d
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:]), d, -8 * d


def _q4_1(raw, rows):
    blocks = raw.reshape(rows, -1, 20)  # fp16 d, fp16 m, 16 bytes of codes; w = q * d + m
    return _nibbles(blocks[..., 4:]), _half(blocks, 0), _half(blocks, 2)


def _q8_0(raw, rows):
    blocks = raw.reshape(rows, -1, 34)  # fp16 d, 32 int8 codes; w = q * d
    d = _half(blocks, 0)
    return blocks[..., 2:].copy().view(np.int8), d, np.zeros_like(d)


def _q5_0(raw, rows):
    # fp16 d, 32 high bits (bit j: value j's fifth bit), 16 bytes of low nibbles; w = (q - 16) * d
    blocks = raw.reshape(rows, -1, 22)
    d = _half(blocks, 0)
    high = blocks[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    codes = (_nibbles(blocks[..., 6:]) | fifth).astype(np.int16) - 16
    return codes.astype(np.int8), d, np.zeros_like(d)


def _q6_k(raw, rows):
    # Super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16
    # values), fp16 d; w = d * scale * (q - 32). Each half of 128 values takes 64 low bytes (byte l: value
    # l's nibble low, l + 64's high; byte 32 + l: values 32 + l and 96 + l) and 32 high bytes (byte l:
    # values l, 32 + l, 64 + l, 96 + l in its bit pairs, lowest first).
    blocks = raw.reshape(-1, 210)
    low = blocks[:, :128].reshape(-1, 2, 1, 2, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (low & 0x0F).reshape(-1, 2, 4, 32) | ((high & 0x03) << 4)
    codes = (q.astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
    scale = _half(blocks, 208)[:, None] * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return codes, scale.reshape(rows, -1), np.zeros_like(scale).reshape(rows, -1)


def _q4_k(raw, rows):
    from gguf.quants import Q4_K

    # Super-blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-scales and sub-mins, then
    # 4 x 32 bytes, each holding two 32-value sub-blocks (low nibbles, then high ones).
    blocks = raw.reshape(-1, 144)
    d, dmin = _half(blocks, 0)[:, None], _half(blocks, 2)[:, None]
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, -1)
    return codes, (d * sc.astype(np.float32)).reshape(rows, -1), -(dmin * mins.astype(np.float32)).reshape(rows, -1)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q6_K": _q6_k}


def read_gguf_tensors(path: str | Path, hf_config) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (hf_parameter_name, tensor): float tensors as float32, quantized ones as QuantizedTensor,
    llama's q/k rows put back in Hugging Face order as transformers' loader does."""
    import torch
    from gguf import GGMLQuantizationType, quants

    data = np.memmap(path, dtype=np.uint8, mode="r")
    names = _gguf_to_hf_names(hf_config)
    for entry in tensor_index(path):
        name = names.get(entry.name)
        if name is None:
            continue
        raw = data[entry.offset:entry.offset + entry.nbytes]
        rows = int(np.prod(entry.shape[1:], dtype=np.int64))  # GGUF lists dimensions innermost first
        if entry.qtype in FLOAT_TYPES:
            values = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType[entry.qtype])
            # A copy (the file is mapped read-only), shaped as PyTorch orders the dimensions.
            yield name, torch.from_numpy(np.array(values, dtype=np.float32)).view(tuple(reversed(entry.shape)))
            continue
        if len(entry.shape) != 2:
            raise ValueError(f"{path}: quantized tensor {entry.name!r} has shape {entry.shape}, expected a matrix")
        weight = QuantizedTensor(entry.qtype, (rows, entry.shape[0]), raw.reshape(rows, -1))
        order = _llama_row_order(entry.name, rows, hf_config)
        yield name, weight if order is None else weight.take_rows(order)


def stored_types(path: str | Path) -> Counter:
    """How many tensors of each GGML type the file holds (from the header alone)."""
    return Counter(entry.qtype for entry in tensor_index(path))


class TensorEntry(NamedTuple):
    name: str
    qtype: str  # GGML type name
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    offset: int  # of its data, from the start of the file
    nbytes: int


# GGUF metadata value types with a fixed size (struct format); 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def tensor_index(path: str | Path) -> list[TensorEntry]:
    """The tensors a GGUF file (version 2 or 3) holds and where their data lies. The gguf package's
    reader parses every metadata value (seconds for a vocabulary); this skips them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        try:
            return _parse_index(str(path), mapped)
        except (struct.error, IndexError, OverflowError) as err:
            raise ValueError(f"{path}: corrupt or truncated GGUF header ({err})") from None


def _parse_index(path: str, buf) -> list[TensorEntry]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(buf) < 24:
        raise ValueError(f"{path}: too short to be a GGUF file")
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
    pos, alignment = 24, 32

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(kind: int, at: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == 8:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in _SCALARS:
            return at + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):
            at = skip(item, at)
        return at

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, pos + 4)
        pos = skip(kind, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        if qtype not in GGMLQuantizationType._value2member_map_:
            raise ValueError(f"{path}: tensor {name!r} has GGML type id {qtype}, unknown to this gguf package")
        infos.append((name, GGMLQuantizationType(qtype), shape, offset))
    start = -(-pos // alignment) * alignment  # the data section begins aligned after the header
    entries = []
    for name, qtype, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        entry = TensorEntry(name, qtype.name, tuple(int(d) for d in shape), start + offset,
                            int(np.prod(shape, dtype=np.int64)) // block * size)
        if entry.offset + entry.nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the GGUF file (truncated?)")
        entries.append(entry)
    return entries


def _gguf_to_hf_names(hf_config) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from the gguf package's name table (the one
    transformers' loader uses), over the parameter names of the decoder families Zipage runs."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == hf_config.model_type)
    table = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    layer_parts = ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                   *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))]
    bases = ["model.embed_tokens", "model.norm", "lm_head",
             *(f"model.layers.{i}.{part}" for i in range(hf_config.num_hidden_layers) for part in layer_parts)]
    names = {}
    for base in bases:
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names.update({f"{gguf_name}.{suffix}": f"{base}.{suffix}" for suffix in ("weight", "bias")})
    return names


def _llama_row_order(gguf_name: str, rows: int, hf_config) -> np.ndarray | None:
    """llama.cpp's converter interleaves the rotary halves of each llama q/k head; this order of
    rows undoes it (the same permutation transformers' loader applies to the float values)."""
    if hf_config.model_type != "llama" or not (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        return None
    heads = hf_config.num_attention_heads if ".attn_q." in gguf_name else hf_config.num_key_value_heads
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
