"""Decode attention alone over bf16, fp8 and int8 caches, per key tile and split-K ways: milliseconds
and the bandwidth reached on the bytes read (codes, scales and block tables' worth of K/V).

    python3 benchmarks/gpu_decode_tiles.py --json out.json
    python3 benchmarks/gpu_decode_tiles.py --shapes 64x2000,1x8000 --tiles 64,128 --ways auto,2,4 --warps 2,4
    python3 benchmarks/gpu_decode_tiles.py --shapes 88x2200 --tiles 64 --ways auto --max-registers auto,128,144

Qwen3-0.6B's attention shape by default (8 KV heads, group 2, head_dim 128, block 256). Each 8-bit
case is checked against the reference on the same codes before it is timed.
"""

from __future__ import annotations

import json

import torch

import bench_common


def cases(args):
    auto = lambda x: None if x == "auto" else int(x)  # noqa: E731
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        for tile in (int(x) for x in args.tiles.split(",")):
            for ways in args.ways.split(","):
                for warps in args.warps.split(","):
                    for registers in args.max_registers.split(","):
                        yield batch, context, tile, auto(ways), auto(warps), auto(registers)


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-0.6b")
    parser.add_argument("--shapes", default="64x2000,256x2000,1x8000", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--tiles", default="64,128", help="keys per step of the decode loop")
    parser.add_argument("--ways", default="auto,2,4", help="split-K partitions (auto: the engine's choice)")
    parser.add_argument("--warps", default="auto", help="warps per program (auto: the engine's choice per cache)")
    parser.add_argument("--max-registers", default="auto",
                        help="registers a thread at most, comma-separated (auto: the engine's cap per cache; "
                             "benchmarks/decode_sass.py shows what a cap spills)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    args = bench_common.parse_args(parser, argv)

    import triton.testing

    from zipage import kernels
    from zipage.kernels import reference as ref
    from zipage.engine.execution.model_runner import KV_CODE_DTYPES
    from zipage.kernels import triton_attention
    from zipage.testing import random_paged_cache

    kernels.use_triton()
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    results = {**bench_common.device_description(dev), "args": vars(args), "rows": []}
    heads, dim = args.kv_heads, args.head_dim
    for batch, context, tile, ways, warps, registers in cases(args):
        k, v, tables = random_paged_cache([context] * batch, args.block_size, heads, dim, gen,
                                          randn=lambda shape: torch.randn(shape, device=dev, dtype=torch.bfloat16))
        tables = tables.to(dev)
        coded = {}
        for name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
            k_codes, k_scales = ref.quantize_rows(k, dtype)
            v_codes, v_scales = ref.quantize_rows(v, dtype)
            # the engine's scale layout: each head's scales of a block contiguous
            k_scales, v_scales = (s.transpose(1, 2).contiguous().transpose(1, 2) for s in (k_scales, v_scales))
            coded[name] = dict(k_cache=k_codes, v_cache=v_codes, k_scales=k_scales, v_scales=v_scales)
        query = torch.randn(batch, heads * args.group, dim, device=dev, dtype=torch.bfloat16)
        ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
        scale = dim ** -0.5
        entries = batch * context * heads

        def attend(cache):
            return lambda: triton_attention.paged_decode_attention_impl(
                query, cache["k_cache"], cache["v_cache"], tables, ctx, scale, num_partitions=ways, block_n=tile,
                k_scales=cache.get("k_scales"), v_scales=cache.get("v_scales"), num_warps=warps,
                max_registers=registers)

        plain = dict(k_cache=k, v_cache=v)
        for label, cache, nbytes in (("bf16", plain, entries * dim * 2 * 2),
                                     ("fp8", coded["fp8"], entries * (dim + 4) * 2),
                                     ("int8", coded["int8"], entries * (dim + 4) * 2)):
            call = attend(cache)
            launch = triton_attention.decode_launch(KV_CODE_DTYPES.get(label, torch.bfloat16))
            row = {"cache": label, "batch": batch, "context": context, "tile": tile, "ways": ways or "auto",
                   "warps": warps or launch.warps, "max_registers": registers or launch.max_registers}
            if label != "bf16":
                expected = ref.paged_decode_attention(query.float(), block_tables=tables, context_lens=ctx,
                                                      scale=scale, **cache)
                out = call().float()
                row["rel_err"] = float((out - expected).norm() / expected.norm())
            ms = triton.testing.do_bench(call, warmup=10, rep=100, return_mode="median")
            row.update(ms=ms, GBps=nbytes / (ms * 1e-3) / 1e9)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del k, v, coded, plain
        torch.cuda.empty_cache()
    bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
