"""PyTorch's int4 CPU product against oneDNN's packed fp32 product, by the number of rows.

    python benchmarks/cpu_int4_kernel.py                  # SmolLM2's gate/up shape, one thread
    python benchmarks/cpu_int4_kernel.py --rows 1,4,5,16 --out 576 --in 1536 --threads 2

Why a quantized layer runs int4 only for products of a few rows (docs/design-notes.md, "Quantized
CPU weights"). Best of 7 calls per product, after one untimed call; the int4 side is
`_weight_int4pack_mm_for_cpu` at group size 32 with bf16 activations (its fast path).
"""

from __future__ import annotations

import argparse
import time

import torch


def best_ms(fn, calls: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,5,8,12,16,32")
    p.add_argument("--out", type=int, default=3072, help="output features (SmolLM2's gate/up: 3072)")
    p.add_argument("--in", dest="inp", type=int, default=576, help="input features, a multiple of 32")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (args.out, args.inp), dtype=torch.int32, generator=gen)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.randn(args.inp // 32, args.out, 2, generator=gen).bfloat16()
    packed32 = torch.ops.mkldnn._reorder_linear_weight(torch.randn(args.out, args.inp, generator=gen), None)
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s), "
          f"weight {args.out} x {args.inp}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.inp, generator=gen)
        xb = x.bfloat16()
        int4 = best_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed4, 32, scales_zeros))
        fp32 = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed32, None, "none", [], ""))
        print(f"{rows:4d} rows: int4 {int4:7.2f} ms   packed fp32 {fp32:7.2f} ms   int4/fp32 {int4 / fp32:5.2f}")


if __name__ == "__main__":
    main()
