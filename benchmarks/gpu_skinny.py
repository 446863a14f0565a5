"""Skinny decode products on the GPU: block sizes per shape, against cuBLAS, and a layer's products
with and without the fused prologues.

    python3 benchmarks/gpu_skinny.py --out DIR [--jobs 14] [--table committed]

1. sweep: for each (N, K) of the Qwen3-0.6B and -8B projections and LM heads, with 1 and 16 rows,
   every candidate kernels.triton_linear.Config, timed as a CUDA graph of back-to-back products whose
   weights rotate through copies larger than L2 (cold, as in a decode step, where every layer has
   its own), against F.linear (cuBLAS) timed the same way. The best configs go to DIR/skinny_table.json
   (the format `load_table` reads; triton_linear.TABLE holds the committed copy).
2. layers: one layer's four products per model and rows 1/4/16, as the plain chain (Triton
   add_rms_norm / silu_and_mul + cuBLAS), skinny products with the elementwise kernels kept apart,
   and skinny products with the norms and SiLU folded in.
Kernels compile in --jobs processes first (into Triton's cache), then time one at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch

MODELS = {  # name: (hidden, q width, kv width, intermediate, vocab)
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 151936),
    "qwen3-8b": (4096, 4096, 1024, 12288, 151936),
}
COLD_BYTES = 256 << 20  # weights a timed graph rotates through: well past the 50 MB of L2


def shapes_of(model: str) -> dict[str, tuple[int, int]]:
    hidden, q, kv, inter, vocab = MODELS[model]
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (vocab, hidden)}


def load_table(path: str) -> dict:
    """A sweep's table into kernels.triton_linear.TABLE (to measure it before it is committed)."""
    from zipage.kernels import triton_linear as tlin

    with open(path) as f:
        rows = json.load(f)["table"]
    table = {tuple(map(int, key.split("x"))): tuple(tlin.Config(**c) for c in pair) for key, pair in rows.items()}
    tlin.TABLE.clear()
    tlin.TABLE.update(table)
    return table


def candidates(n: int, k: int, rows: int, lm_head: bool = False):
    from zipage.kernels.triton_linear import Config

    for dot in ((False, True) if rows == 1 else (True,)):
        for bn in ((32, 64) if lm_head else (16, 32, 64)):
            for bk in (128, 256, 512):
                if not dot and bn * bk > 16384:  # the fp32 accumulator tile lives in registers
                    continue
                tiles = math.ceil(n / bn)
                for split in ((1,) if lm_head else (1, 2, 4, 8)):
                    k_split = math.ceil(math.ceil(k / split) / bk) * bk
                    if split > 1 and (math.ceil(k / k_split) != split or tiles * split // 2 >= 4 * 132):
                        continue
                    for warps in ((4, 8) if bn * bk >= 8192 else (4,)):
                        for stages in ((3, 5) if dot else (3,)):
                            yield Config(bn, bk, split, dot, warps, stages)


def _compile(jobs: list) -> list:
    """Worker: run each (n, k, rows, config, prologue, bias, dtype) once; returns the failures."""
    from zipage.kernels import triton_linear as tlin

    failed = []
    for n, k, rows, cfg, prologue, bias, dtype in jobs:
        dt = getattr(torch, dtype)
        try:
            w = torch.empty((n, k), dtype=dt, device="cuda").normal_()
            x = torch.randn(rows, 2 * k if prologue == tlin.SILU_MUL else k, dtype=dt, device="cuda")
            nw = torch.ones(k, dtype=dt, device="cuda")
            tlin.skinny_matmul(x, w, torch.zeros(n, dtype=dt, device="cuda") if bias else None, prologue,
                               torch.randn_like(x) if prologue == tlin.ADD_NORM else None, nw, 1e-6,
                               config=tlin.Config(**cfg))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - e.g. too much shared memory: recorded, skipped
            failed.append((cfg, f"{type(e).__name__}: {str(e)[:200]}"))
    return failed


def precompile(jobs: list, workers: int) -> list:
    if workers <= 1:
        return _compile(jobs)
    chunks = [jobs[i::workers] for i in range(workers)]
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return [f for part in pool.map(_compile, chunks) for f in part]


def graph_us(calls, repeats: int = 2) -> float:
    """Microseconds per call of a CUDA graph holding `calls` (a list of thunks), run back to back."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / (repeats * len(calls))


def weight_copies(n: int, k: int, dtype) -> list[torch.Tensor]:
    count = min(64, max(2, math.ceil(COLD_BYTES / (n * k * 2))))
    return [torch.empty((n, k), dtype=dtype, device="cuda").normal_(0, k ** -0.5) for _ in range(count)]


def sweep(out: dict, jobs: int, log) -> dict:
    from zipage.kernels import triton_linear as tlin

    dt = torch.bfloat16
    shapes = {}
    for model in MODELS:
        for name, nk in shapes_of(model).items():
            shapes.setdefault(nk, f"{model} {name}")
    plan = [(n, k, rows, c) for (n, k) in shapes for rows in (1, 16)
            for c in candidates(n, k, rows, lm_head=n > 100000)]
    # Kernels specialise on constexprs and alignment, not on sizes: one compile per config, at
    # a stand-in shape with the same alignment (every K here is a multiple of every BLOCK_K).
    unique = {c: rows for n, k, rows, c in plan}
    start = time.perf_counter()
    failed = precompile([(1024, 4096, rows, asdict(c), tlin.PLAIN, False, "bfloat16")
                         for c, rows in unique.items()], jobs)
    bad = {json.dumps(c, sort_keys=True) for c, _ in failed}
    log(f"compiled {len(unique)} configs in {time.perf_counter() - start:.0f} s, {len(bad)} failed")
    out["compile_failures"] = failed[:20]
    results = out.setdefault("sweep", [])
    table = {}
    for (n, k), label in shapes.items():
        weights = weight_copies(n, k, dt)
        calls = max(16, len(weights))
        best = {}
        for rows in (1, 16, 4):
            x = torch.randn(rows, k, dtype=dt, device="cuda")
            cublas = graph_us([lambda w=weights[i % len(weights)]: torch.nn.functional.linear(x, w)
                               for i in range(calls)])
            row = {"shape": label, "n": n, "k": k, "rows": rows, "cublas_us": cublas,
                   "cublas_TBps": n * k * 2 / cublas / 1e6}
            if rows == 4:  # timed at the 16-row pick, which it uses
                tried = [best[16][1]]
            else:
                tried = [c for nn, kk, r, c in plan if (nn, kk, r) == (n, k, rows)
                         and json.dumps(asdict(c), sort_keys=True) not in bad]
            timed = []
            for c in tried:
                try:
                    us = graph_us([lambda w=weights[i % len(weights)], c=c: tlin.skinny_matmul(x, w, None, config=c)
                                   for i in range(calls)])
                    timed.append((us, c))
                except Exception as e:  # noqa: BLE001
                    log(f"  {label} {c}: {type(e).__name__}: {str(e)[:120]}")
            if not timed:
                log(f"  {label} M{rows}: no config ran")
                break
            timed.sort(key=lambda t: t[0])
            best[rows] = timed[0]
            us, c = timed[0]
            row.update(best_us=us, best_TBps=n * k * 2 / us / 1e6, speedup=cublas / us, config=asdict(c),
                       runners_up=[(round(u, 2), asdict(cc)) for u, cc in timed[1:4]], tried=len(timed))
            if rows == 1:
                sums = [t for t in timed if not t[1].dot]
                dots = [t for t in timed if t[1].dot]
                row["best_sum_us"] = sums[0][0] if sums else None
                row["best_dot_us"] = dots[0][0] if dots else None
            results.append(row)
            log(f"  {label:22s} M{rows:<2d} cuBLAS {cublas:7.1f} us ({row['cublas_TBps']:.2f} TB/s)  "
                f"skinny {us:7.1f} us ({row['best_TBps']:.2f} TB/s)  x{row['speedup']:.2f}  {c}")
        if 1 in best and 16 in best:
            table[f"{n}x{k}"] = [asdict(best[1][1]), asdict(best[16][1])]
        del weights
        torch.cuda.empty_cache()
    out["table"] = table
    return table


def layer_chains(out: dict, jobs: int, log) -> None:
    """One decoder layer's products: plain chain vs skinny vs skinny with prologues fused."""
    from zipage.kernels import triton_fused as tf
    from zipage.kernels import triton_linear as tlin

    F = torch.nn.functional
    dt = torch.bfloat16
    eps = 1e-6
    # Compile the picked configs with every prologue first.
    job_list = [(n, k, rows, asdict(c), p, False, "bfloat16") for (n, k), pair in tlin.TABLE.items() if n < 100000
                for rows, c in zip((1, 16), pair) for p in (tlin.PLAIN, tlin.NORM, tlin.ADD_NORM, tlin.SILU_MUL)]
    precompile(job_list, jobs)
    rows_out = out.setdefault("layers", [])
    for model in MODELS:
        s = shapes_of(model)
        hidden, inter = s["qkv"][1], s["down"][1]
        layer_bytes = sum(n * k * 2 for name, (n, k) in s.items() if name != "lm_head")
        copies = max(2, math.ceil(COLD_BYTES / layer_bytes))
        layers = [{name: torch.empty(nk, dtype=dt, device="cuda").normal_(0, nk[1] ** -0.5)
                   for name, nk in s.items() if name != "lm_head"} for _ in range(copies)]
        nw1 = torch.ones(hidden, dtype=dt, device="cuda")
        nw2 = torch.ones(hidden, dtype=dt, device="cuda")
        for rows in (1, 4, 16):
            h = torch.randn(rows, hidden, dtype=dt, device="cuda")
            res = torch.randn(rows, hidden, dtype=dt, device="cuda")
            attn = torch.randn(rows, s["o"][1], dtype=dt, device="cuda")

            def plain(L):
                normed, summed = tf.add_rms_norm(h, res, nw1, eps)
                F.linear(normed, L["qkv"])
                o = F.linear(attn, L["o"])
                normed, summed = tf.add_rms_norm(o, summed, nw2, eps)
                F.linear(tf.silu_and_mul(F.linear(normed, L["gate_up"])), L["down"])

            def skinny_apart(L):
                normed, summed = tf.add_rms_norm(h, res, nw1, eps)
                tlin.linear(normed, L["qkv"], None)
                o = tlin.linear(attn, L["o"], None)
                normed, summed = tf.add_rms_norm(o, summed, nw2, eps)
                tlin.linear(tf.silu_and_mul(tlin.linear(normed, L["gate_up"], None)), L["down"], None)

            def skinny_fused(L):
                mm = tlin.skinny_matmul
                _, summed = mm(h, L["qkv"], None, tlin.ADD_NORM, res, nw1, eps)
                o = mm(attn, L["o"], None)[0]
                gu, summed = mm(o, L["gate_up"], None, tlin.ADD_NORM, summed, nw2, eps)
                mm(gu, L["down"], None, tlin.SILU_MUL)

            row = {"model": model, "rows": rows, "layer_MB": layer_bytes / 1e6}
            for name, fn in (("plain_us", plain), ("skinny_apart_us", skinny_apart), ("skinny_fused_us", skinny_fused)):
                row[name] = graph_us([lambda L=layers[i % copies], fn=fn: fn(L) for i in range(max(8, copies))])
            row["fused_TBps"] = layer_bytes / row["skinny_fused_us"] / 1e6
            rows_out.append(row)
            log(f"  layer {model} M{rows}: plain {row['plain_us']:.1f} us, skinny {row['skinny_apart_us']:.1f}, "
                f"skinny fused {row['skinny_fused_us']:.1f} ({row['fused_TBps']:.2f} TB/s)")
        del layers
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--table", default=None, help="skip the sweep: time the layers with this table "
                        "('committed': kernels.triton_linear.TABLE as it is)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log = lambda line: print(line, flush=True)  # noqa: E731
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    path = os.path.join(args.out, "skinny_table.json")

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    try:
        if args.table == "committed":
            pass
        elif args.table:
            load_table(args.table)
        else:
            sweep(out, args.jobs, log)
            save()
            load_table(path)
        layer_chains(out, args.jobs, log)
    finally:
        save()
        log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
