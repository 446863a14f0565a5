"""Decode attention alone over bf16, fp8 and int8 caches, per key tile and split-K ways: microseconds
and the bandwidth reached on the bytes read (codes, scales and block tables' worth of K/V).

    python3 benchmarks/gpu_decode_tiles.py --json out.json
    python3 benchmarks/gpu_decode_tiles.py --shapes 64x2000,1x8000 --tiles 64,128 --ways auto,2,4 --warps 2,4
    python3 benchmarks/gpu_decode_tiles.py --shapes 88x2200 --tiles 64 --ways auto --max-registers auto,128,144
    python3 benchmarks/gpu_decode_tiles.py --shapes 47x2200 --tiles 64 --ways 1,2 --rounds 7

Qwen3-0.6B's attention shape by default (8 KV heads, group 2, head_dim 128, block 256). Each shape
draws one cache; every variant of it (tile, ways, warps, register cap, each cache kind) is checked
against the reference on the same codes, then timed in --rounds interleaved rounds: a row gives the
median and the spread (fastest, slowest) of its rounds. One round can mislead: some launches (two
split-K partitions of int8 at 45-47 sequences) swing by half from one timing to the next.
--device cpu runs the same under the Triton interpreter (TRITON_INTERPRET=1; tiny shapes), timed by
the wall clock: a check of the script, not a benchmark.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time

import torch

import bench_common

CACHES = (("bf16", None), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8))


def variants(args):
    auto = lambda x: None if x == "auto" else int(x)  # noqa: E731
    for tile in (int(x) for x in args.tiles.split(",")):
        for ways in args.ways.split(","):
            for warps in args.warps.split(","):
                for registers in args.max_registers.split(","):
                    for stages in (auto(x) for x in args.stages.split(",")):
                        for ahead in (auto(x) for x in args.table_ahead.split(",")):
                            yield tile, auto(ways), auto(warps), auto(registers), stages, ahead


def cache_variants(args):
    """(label, dtype, launch variant) for every cache; a cache in the model's dtype takes only the
    variants that are not about 8-bit codes (engine, tma)."""
    for label, dtype in CACHES:
        for codes in args.codes.split(","):
            if dtype is not None or codes in ("engine", "tma"):
                yield label, dtype, codes


def code_launch(launch, codes: str):
    """The decode launch of a --codes variant."""
    variants = {"engine": lambda: launch, "ptx": launch.with_ptx_codes,
                "masked": lambda: dataclasses.replace(launch, whole_tiles=False),
                "tma": lambda: dataclasses.replace(launch, whole_tiles=True, tma=True)}
    if codes not in variants:
        raise SystemExit(f"--codes: unknown variant {codes!r} ({', '.join(variants)})")
    return variants[codes]()


def time_us(call, device: str) -> float:
    """One timing of call in µs: triton's do_bench median on a GPU, the wall clock of one call off it."""
    if device == "cpu":
        start = time.perf_counter()
        call()
        return 1e6 * (time.perf_counter() - start)
    import triton.testing

    return 1000 * triton.testing.do_bench(call, warmup=10, rep=100, return_mode="median")


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-0.6b")
    parser.add_argument("--shapes", default="64x2000,256x2000,1x8000", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--tiles", default="64,128", help="keys per step of the decode loop")
    parser.add_argument("--ways", default="auto,2,4", help="split-K partitions (auto: the engine's choice)")
    parser.add_argument("--warps", default="auto", help="warps per program (auto: the engine's choice per cache)")
    parser.add_argument("--max-registers", default="auto",
                        help="registers a thread at most, comma-separated (auto: the engine's cap per cache; "
                             "benchmarks/decode_sass.py shows what a cap spills)")
    parser.add_argument("--stages", default="auto",
                        help="copy pipeline stages of the key loop, comma-separated (auto: the launch's)")
    parser.add_argument("--table-ahead", default="auto",
                        help="table entries the whole-tile loop holds in registers at a time, comma-separated "
                             "(0: one loaded a tile; auto: the launch's)")
    parser.add_argument("--codes", default="engine",
                        help="8-bit caches' launches, comma-separated: engine (the launch's), ptx (fp16 products "
                             "through codes_as's PTX), masked (every tile through the masked loop, which the copy "
                             "pipeline reads further ahead at 3 stages or more), tma (whole tiles by bulk copy, "
                             "every cache)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timings of every variant of a shape")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script under the interpreter")
    args = bench_common.parse_args(parser, argv)

    from zipage import kernels
    from zipage.kernels import reference as ref
    from zipage.kernels import triton_attention
    from zipage.testing import random_paged_cache

    dev = args.device
    if dev == "cpu":
        from zipage.kernels import triton_ops

        triton_ops.patch_interpreter_for_numpy2()
    kernels.use_triton()
    model_dtype = torch.bfloat16 if dev != "cpu" else torch.float32  # (the interpreter's bf16 tl.dot is wrong)
    gen = torch.Generator().manual_seed(0)
    results = {**bench_common.device_description(dev), "args": vars(args), "rows": []}
    heads, dim = args.kv_heads, args.head_dim
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        k, v, tables = random_paged_cache([context] * batch, args.block_size, heads, dim, gen,
                                          randn=lambda s: torch.randn(s, device=dev, dtype=model_dtype))
        tables = tables.to(dev)
        caches = {"bf16": dict(k_cache=k, v_cache=v)}
        for name, dtype in CACHES[1:]:
            k_codes, k_scales = ref.quantize_rows(k, dtype)
            v_codes, v_scales = ref.quantize_rows(v, dtype)
            # the engine's scale layout: each head's scales of a block contiguous
            k_scales, v_scales = (s.transpose(1, 2).contiguous().transpose(1, 2) for s in (k_scales, v_scales))
            caches[name] = dict(k_cache=k_codes, v_cache=v_codes, k_scales=k_scales, v_scales=v_scales)
        query = torch.randn(batch, heads * args.group, dim, device=dev, dtype=model_dtype)
        ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
        scale = dim ** -0.5
        entries = batch * context * heads
        nbytes = {"bf16": entries * dim * 2 * 2, "fp8": entries * (dim + 4) * 2, "int8": entries * (dim + 4) * 2}

        # every kind against the fp32 reference on its own entries (bf16 ones read as fp32)
        as_read = {**caches, "bf16": {name: c.float() for name, c in caches["bf16"].items()}}
        expected = {label: ref.paged_decode_attention(query.float(), block_tables=tables, context_lens=ctx,
                                                      scale=scale, **as_read[label]) for label, _ in CACHES}
        del as_read
        rows, calls = [], []
        for tile, ways, warps, registers, stages, ahead in variants(args):
            for label, dtype, codes in cache_variants(args):
                cache = caches[label]
                launch = code_launch(triton_attention.decode_launch(dtype or model_dtype), codes)
                if ahead is not None:
                    launch = dataclasses.replace(launch, table_ahead=ahead)
                call = functools.partial(
                    triton_attention.paged_decode_attention_impl, query, cache["k_cache"], cache["v_cache"], tables,
                    ctx, scale, num_partitions=ways, block_n=tile, k_scales=cache.get("k_scales"),
                    v_scales=cache.get("v_scales"), num_warps=warps, max_registers=registers, num_stages=stages,
                    launch=launch)
                row = {"cache": label, "batch": batch, "context": context, "tile": tile, "ways": ways or "auto",
                       "warps": warps or launch.warps, "max_registers": registers or launch.max_registers,
                       "stages": stages or launch.stages, "codes": codes, "table_ahead": launch.table_ahead}
                row["rel_err"] = float((call().float() - expected[label]).norm() / expected[label].norm())
                rows.append(row)
                calls.append(call)
        timings = [[] for _ in calls]
        for _ in range(args.rounds):
            for call, times in zip(calls, timings):
                times.append(time_us(call, dev))
        for row, times in zip(rows, timings):
            us = statistics.median(times)
            row.update(us=us, fastest_us=min(times), slowest_us=max(times),
                       GBps=nbytes[row["cache"]] / (us * 1e-6) / 1e9)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del k, v, caches
        if dev != "cpu":
            torch.cuda.empty_cache()
        bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
