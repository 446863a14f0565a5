"""The CPU's quantized products against the float copies' products (FBGEMM float16, oneDNN fp32), by rows.

    python benchmarks/cpu_int4_kernel.py                  # SmolLM2's gate/up shape, one thread
    python benchmarks/cpu_int4_kernel.py --rows 1,4,5,16 --out 576 --in 1536 --threads 2
    python benchmarks/cpu_int4_kernel.py --layers 30 --threads 2    # a whole SmolLM2's layer products
    python benchmarks/cpu_int4_kernel.py --out 49152 --in 576 --bits 8 --threads 2   # its Q8_0 LM head

Why a quantized layer runs int4 only for products of a few rows, and its float16 copy for the rest
(docs/design-notes.md, "Quantized CPU weights"). Best of 7 calls per product, after one untimed call;
the int4 side is `_weight_int4pack_mm_for_cpu` at group size 32 with bf16 activations (its fast path),
the float16 copy `cpu_products.HalfWeight` (float32 activations and outputs), the native product
(`zipage.kernels.cpu`: activations quantized to int16 per 32 values, then integer sums; `--bits 8` for
Q8_0's and Q5_0's codes, `--bits 6` for Q6_K's), quantizing included; where its products are AVX-512, the same source built for AVX2
beside it. One weight
stays in the CPU's caches from call to call; with --layers N, every timed call runs the products of
N layers of SmolLM2's shapes (fused q/k/v, o, fused gate/up, down), each weight its own, so the
weights stream from memory as in a decode step.
"""

from __future__ import annotations

import argparse
import time

import torch

from zipage.engine.cpu_products import HalfWeight, half_product_works
from zipage.engine.loading.loader import c_compiler, cache_dir
from zipage.kernels.cpu.native import NativeLibrary, NativeUnavailable, build, native_library, pack_weight

SMOLLM2_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate/up, down


def best_ms(fn, calls: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def weights(out: int, inp: int, gen: torch.Generator, bits: int) -> tuple:
    """One weight in four forms: packed int4 codes with bf16 scales-and-zeros, packed fp32, the
    float16 copy (None without FBGEMM), and the native form (`bits`-bit codes, scales, offsets)."""
    codes = torch.randint(0, 16, (out, inp), dtype=torch.int32, generator=gen)
    native_codes = codes if bits == 4 else torch.randint(-32 if bits == 6 else -127, 32 if bits == 6 else 128,
                                                         (out, inp), generator=gen)
    per_scale = 16 if bits == 6 else 32  # layout 6: Q6_K's codes, a scale per 16 values
    native = pack_weight(native_codes, (torch.rand(out, inp // per_scale, generator=gen) * 0.01).half(),
                         (torch.randn(out, inp // 32, generator=gen) * 0.01).half() if bits == 4 else None, bits)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.randn(inp // 32, out, 2, generator=gen).bfloat16()
    values = torch.randn(out, inp, generator=gen) * 0.05
    packed32 = torch.ops.mkldnn._reorder_linear_weight(values, None)
    return inp, packed4, scales_zeros, packed32, HalfWeight(values) if half_product_works() else None, native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,5,8,12,16,32")
    p.add_argument("--out", type=int, default=3072, help="output features (SmolLM2's gate/up: 3072)")
    p.add_argument("--in", dest="inp", type=int, default=576, help="input features, a multiple of 32")
    p.add_argument("--layers", type=int, default=0, help="time N layers of SmolLM2's products instead of one weight")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bits", type=int, choices=(4, 6, 8), default=4,
                   help="the native form's layout: 4 (Q4_*), 8 (Q8_0, Q5_0) or 6 (Q6_K)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = SMOLLM2_LAYER * args.layers if args.layers else [(args.out, args.inp)]
    forms = [weights(out, inp, gen, args.bits) for out, inp in shapes]
    try:
        native = native_library(cache_dir() / "native", c_compiler())
    except NativeUnavailable as error:
        native = None
        print(f"no native kernels: {error}")
    avx2 = None  # the AVX2 products, to weigh the AVX-512 ones against
    if native is not None and native.vector_path == "AVX-512":
        avx2 = NativeLibrary(build(cache_dir() / "native-avx2", c_compiler(), defines=("ZQ_NO_AVX512",)))
    what = f"{args.layers} layers of SmolLM2's products" if args.layers else f"weight {args.out} x {args.inp}"
    path = f", native {native.vector_path}" if native is not None else ""
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s), "
          f"{what}{path}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {inp: torch.randn(rows, inp, generator=gen) for inp in {inp for _, inp in shapes}}
        xb = {inp: v.bfloat16() for inp, v in x.items()}

        def int4_products():
            for inp, packed4, scales_zeros, *_ in forms:
                torch.ops.aten._weight_int4pack_mm_for_cpu(xb[inp], packed4, 32, scales_zeros)

        def fp32_products():
            for inp, _, _, packed32, *_ in forms:
                torch.ops.mkldnn._linear_pointwise(x[inp], packed32, None, "none", [], "")

        def fp16_products():
            for inp, *_, half, _ in forms:
                half(x[inp])

        def native_matmuls(library=native):
            for inp, *_, weight in forms:
                library.linear(x[inp], weight, args.threads)

        int4, fp32 = best_ms(int4_products), best_ms(fp32_products)
        fp16 = f"{best_ms(fp16_products):7.2f} ms" if half_product_works() else "(no FBGEMM)"
        own = f"{best_ms(native_matmuls):7.2f} ms" if native is not None else "(none)"
        own_avx2 = f"   native AVX2 {best_ms(lambda: native_matmuls(avx2)):7.2f} ms" if avx2 is not None else ""
        print(f"{rows:4d} rows: int4 {int4:7.2f} ms   float16 copy {fp16}   packed fp32 {fp32:7.2f} ms   "
              f"native {own}{own_avx2}")


if __name__ == "__main__":
    main()
