"""The native CPU products (zipage/kernels/cpu, docs/design-notes.md "Native CPU products"): activations
quantized exactly as the PyTorch reference does, products against the float64 reference and the
dequantized weight for both widths and every row pattern, in the vector build and the portable one,
real GGUF blocks, and the refusals (bad layouts, no compiler, a failed build)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from zipage.engine.execution.models.quantized import Kernels
from zipage.engine.loading.gguf_tensors import QuantizedTensor
from zipage.kernels.cpu.native import (GroupedWeight, NativeProducts, NativeUnavailable, build, pack_weight)
from zipage.kernels.reference import grouped_int16_matmul, quantize_groups_int16


@pytest.fixture(scope="module", params=["vector", "portable"])
def products(request, tmp_path_factory) -> NativeProducts:
    """The library as this machine builds it, and its portable loops (what a CPU without AVX2 runs)."""
    defines = ("ZQ_PORTABLE",) if request.param == "portable" else ()
    lib = NativeProducts(build(tmp_path_factory.mktemp("native"), defines=defines))
    assert not lib.vectorized if defines else lib.vectorized == (torch.backends.cpu.get_cpu_capability() != "DEFAULT")
    return lib


def random_weight(n: int, k: int, bits: int, gen: torch.Generator):
    """(integer codes, float16 scales, float16 offsets or None) of a random grouped weight."""
    values = torch.randint(0, 16, (n, k), generator=gen) if bits == 4 else torch.randint(-128, 128, (n, k), generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half()
    low = (torch.randn(n, k // 32, generator=gen) * 0.05).half() if bits == 4 else None
    return values, scale, low


def dequantized(values, scale, low) -> torch.Tensor:
    n, k = values.shape
    w = values.double().view(n, k // 32, 32) * scale.double()[..., None]
    if low is not None:
        w = w + low.double()[..., None]
    return w.view(n, k)


def test_activations_quantize_exactly_as_the_reference(products):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=gen) * 3
    x[1, 32:64] = 0  # an all-zero group: codes 0, scale 0
    x[2, :32] = torch.arange(32) - 15.5  # halves after scaling: ties go to even
    x[3, 64:96] = 1e-30  # tiny values
    codes, scale, total = products.quantize(x)
    want_codes, want_scale, want_total = quantize_groups_int16(x)
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert torch.equal(total, want_total)
    assert int(codes.abs().max()) == 32767 and float(scale[1, 1]) == 0.0


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_the_product_matches_the_reference_for_every_row_pattern(products, bits, rows):
    gen = torch.Generator().manual_seed(10 * bits + rows)
    values, scale, low = random_weight(64, 256, bits, gen)
    x = torch.randn(rows, 256, generator=gen)
    got = products.linear(x, pack_weight(values, scale, low, bits), threads=1)
    want = grouped_int16_matmul(values, scale, low if low is not None else torch.zeros_like(scale), *quantize_groups_int16(x))
    assert got.dtype == torch.float32 and got.shape == (rows, 64)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # and against the weight itself times the float activations: the int8 rounding of x is all it adds
    exact = x.double() @ dequantized(values, scale, low).T
    assert float((got.double() - exact).norm() / exact.norm()) < 1e-2


def test_threads_split_the_outputs_without_changing_a_bit(products):
    gen = torch.Generator().manual_seed(3)
    values, scale, low = random_weight(96, 512, 4, gen)
    weight, x = pack_weight(values, scale, low, 4), torch.randn(3, 512, generator=gen)
    assert torch.equal(products.linear(x, weight, threads=1), products.linear(x, weight, threads=2))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_real_gguf_blocks_give_the_dequantized_product(products, qtype):
    rng = np.random.default_rng(4)
    values = (rng.standard_normal((48, 320)) * 0.05).astype(np.float32)
    tensor = QuantizedTensor(qtype, (48, 320), quants.quantize(values, GGMLQuantizationType[qtype]))
    groups = tensor.groups()
    bits = 8 if qtype == "Q8_0" else 4
    weight = pack_weight(groups.codes, groups.scale, groups.low if bits == 4 else None, bits)
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(5))
    want = x.double() @ tensor.dequantize().double().T
    got = products.linear(x, weight, threads=2)
    assert float((got.double() - want).norm() / want.norm()) < 1e-2


def test_bad_layouts_and_inputs_are_refused(products):
    gen = torch.Generator().manual_seed(6)
    values, scale, low = random_weight(8, 64, 4, gen)
    with pytest.raises(ValueError, match="not blocks of 4 rows"):
        pack_weight(values[:6], scale[:6], low[:6], 4)
    with pytest.raises(ValueError, match="float16 values"):
        pack_weight(values, scale.float() + 1e-5, low, 4)
    with pytest.raises(ValueError, match="4-bit codes take an offset"):
        pack_weight(values, scale, None, 4)
    with pytest.raises(ValueError, match="are not 8-bit groups"):
        GroupedWeight(pack_weight(values, scale, low, 4).blocks, 8)
    weight = pack_weight(values, scale, low, 4)
    with pytest.raises(ValueError, match="float32 rows"):
        products.linear(torch.randn(2, 64).double(), weight, threads=1)
    with pytest.raises(ValueError, match="rows of 96 values against a weight of 64 columns"):
        products.linear(torch.randn(2, 96), weight, threads=1)
    with pytest.raises(ValueError, match="whole groups of 32"):
        products.linear(torch.randn(2, 40), weight, threads=1)
    with pytest.raises(ValueError, match="float32 rows"):
        products.linear(torch.randn(64, 2).T, weight, threads=1)  # not contiguous


def test_no_compiler_or_a_failed_build_is_said_plainly(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeUnavailable, match="no C compiler: 'no-such-compiler' is not on PATH"):
        build(tmp_path)
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(NativeUnavailable, match="could not build q8_products.c"):
        build(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


def test_which_kernel_runs_which_weight_and_why_not():
    here, bare = Kernels.here(), Kernels(native=None, int4=False, why_native="no C compiler")
    assert here.native is not None  # a C compiler is part of the test machine's set-up
    assert here.short_form({"Q4_1"}, 64) == ("native", None)
    assert here.short_form({"Q8_0"}, 64) == ("native", None)
    assert here.short_form({"Q4_K"}, 64) == ("int4", None)
    assert here.short_form({"Q4_1"}, 6) == (None, "integer dots need a multiple of 4 output rows, not 6; "
                                                  "the int4 kernel needs a multiple of 16 output rows, not 6")
    assert here.short_form({"Q4_1", "Q8_0"}, 64) == (None, "the fused parts are stored in different types")
    assert here.short_form({"Q5_0"}, 64) == (None, "no CPU kernel for Q5_0 blocks")
    assert bare.short_form({"Q8_0"}, 64) == (None, "no integer dots here; PyTorch's int8 kernel takes one scale per "
                                                   "row, Q8_0 has one per 32 values")
    assert bare.short_form({"Q4_0"}, 64) == (None, "no integer dots here; this torch has no working int4 CPU kernel")
