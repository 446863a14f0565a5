"""The PTX blocks the decode kernel converts 8-bit codes with (triton_attention.E4M3_TO_F16_PTX,
INT8_TO_F16_PTX) give every code's exact value. The interpreter runs no PTX, so the text itself is
run here by a small model of the instructions it uses (each as the PTX ISA defines it), on every
byte value in every lane of the packed register; benchmarks/gpu_check.py runs the kernels on a GPU."""

import os
import re

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below, as the kernel tests do

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from zipage.kernels import triton_attention as ta  # noqa: E402


def _f16_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float16).view(np.uint16))


def _f16(bits: int) -> float:
    return float(np.array(bits, dtype=np.uint16).view(np.float16))


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 d, a, b, c (default mode): byte i of d is byte (c's nibble i) of b:a."""
    pool = (b << 32) | a
    return sum(((pool >> (8 * ((selector >> (4 * i)) & 0x7))) & 0xFF) << (8 * i) for i in range(4))


def _f16x2(op, x: int, y: int) -> int:
    lo = op(_f16(x & 0xFFFF), _f16(y & 0xFFFF))
    hi = op(_f16(x >> 16), _f16(y >> 16))
    return _f16_bits(lo) | (_f16_bits(hi) << 16)


def _e4m3_pair(bits16: int) -> int:
    """cvt.rn.f16x2.e4m3x2: the low byte to the low half, the high byte to the high half."""
    lo, hi = (torch.tensor([bits16 & 0xFF, bits16 >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
              .to(torch.float16).view(torch.int16).tolist())
    return (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)


def run_ptx(text: str, word: int) -> tuple[int, int]:
    """Run a conversion block on the 32-bit input $2; returns ($0, $1)."""
    regs = {"$2": word}
    value = lambda tok: int(tok, 16) if tok.startswith("0x") else regs[tok]  # noqa: E731
    body = text.strip()[1:-1]
    for statement in filter(None, (s.strip() for s in body.split(";"))):
        op, _, rest = statement.partition(" ")
        if op == ".reg":
            continue
        unpack = re.fullmatch(r"\{(\w+), (\w+)\}, (\S+)", rest)
        if op == "mov.b32" and unpack:
            lo, hi, src = unpack.groups()
            regs[lo], regs[hi] = value(src) & 0xFFFF, value(src) >> 16
            continue
        args = [a.strip() for a in rest.split(",")]
        dst, srcs = args[0], [value(a) for a in args[1:]]
        if op == "mov.b32":
            regs[dst] = srcs[0]
        elif op == "xor.b32":
            regs[dst] = srcs[0] ^ srcs[1]
        elif op == "prmt.b32":
            regs[dst] = _prmt(*srcs)
        elif op == "sub.rn.f16x2":
            regs[dst] = _f16x2(lambda x, y: x - y, *srcs)
        elif op == "cvt.rn.f16x2.e4m3x2":
            regs[dst] = _e4m3_pair(srcs[0])
        else:
            raise AssertionError(f"no model of {op!r}")
    return regs["$0"], regs["$1"]


def _halves(reg: int) -> list[float]:
    return [_f16(reg & 0xFFFF), _f16(reg >> 16)]


@pytest.mark.parametrize("dtype,ptx", [(torch.int8, ta.INT8_TO_F16_PTX.value),
                                       (torch.float8_e4m3fn, ta.E4M3_TO_F16_PTX.value)])
def test_every_code_converts_exactly_in_every_lane(dtype, ptx):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if dtype == torch.float8_e4m3fn:  # NaN codes (0x7F, 0xFF) are never stored: the store saturates
        codes = codes[(codes & 0x7F) != 0x7F]
    expected = codes.view(dtype).to(torch.float32).tolist()
    bytes_ = codes.tolist()
    for lane in range(4):
        for byte, want in zip(bytes_, expected):
            # the other lanes hold other codes, so a selector that took the wrong byte shows
            others = [(byte + 37 * (i + 1)) % 256 for i in range(4)]
            if dtype == torch.float8_e4m3fn:
                others = [o if (o & 0x7F) != 0x7F else 0 for o in others]
            lanes = [byte if i == lane else others[i] for i in range(4)]
            word = sum(b << (8 * i) for i, b in enumerate(lanes))
            out = _halves(run_ptx(ptx, word)[0]) + _halves(run_ptx(ptx, word)[1])
            want_all = torch.tensor(lanes, dtype=torch.uint8).view(dtype).to(torch.float32).tolist()
            assert out == want_all, (hex(word), out, want_all)
            assert out[lane] == want


def test_model_of_prmt_follows_the_isa():
    """The PTX ISA's own example: prmt.b32 with selector 0x3210 returns a unchanged; 0x7654, b."""
    a, b = 0x44332211, 0x88776655
    assert _prmt(a, b, 0x3210) == a and _prmt(a, b, 0x7654) == b
    assert _prmt(a, b, 0x0123) == 0x11223344
