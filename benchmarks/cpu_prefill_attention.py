"""The CPU path's prefill attention for one fresh prompt, with queries in tiles and in one call:
seconds for one layer at a model's attention shape (default SmolLM2-135M: 9 query heads, 3 KV heads,
head dim 64), for several prompt lengths.

    python benchmarks/cpu_prefill_attention.py --lengths 2048,4096,8192
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_common import cpu_description
from zipage.kernels import reference


def one_layer(n: int, heads: int, kv_heads: int, head_dim: int, tile: int, block_size: int = 32) -> float:
    gen = torch.Generator().manual_seed(n)
    blocks = -(-n // block_size)
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(n, heads, head_dim, generator=gen)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    cu, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    saved, reference.PREFILL_QUERY_TILE = reference.PREFILL_QUERY_TILE, tile
    try:
        start = time.perf_counter()
        reference.prefill_attention(q, k, v, table, cu, lens, head_dim ** -0.5)
        return time.perf_counter() - start
    finally:
        reference.PREFILL_QUERY_TILE = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        row = {"tokens": n}
        for name, tile in (("one call", 1 << 30), (f"tiles of {reference.PREFILL_QUERY_TILE}", reference.PREFILL_QUERY_TILE)):
            row[name] = round(one_layer(n, args.heads, args.kv_heads, args.head_dim, tile), 2)
        rows.append(row)
        print(row, flush=True)
    print(json.dumps({"hardware": cpu_description(), "seconds_per_layer": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
