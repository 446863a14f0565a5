"""The host's work in a decode step of many requests, with compression on (no request near its budget)
and off: planning the step, packing its metadata, applying its tokens. On the GPU this work runs
beside the device's step; at hundreds of requests it can be as long.

    python benchmarks/host_bookkeeping.py
    python benchmarks/host_bookkeeping.py --requests 256 --steps 100 --rounds 2 --json out.json

A tiny random Qwen3 on the CPU, one thread; the budget (--budget-blocks, in blocks of 32) is far
above every request's length, so the compressed engine never compresses: what differs is the
bookkeeping alone. Rounds alternate the two modes; the median of each part is kept.
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import time

import torch

import bench_common

PARTS = (("scheduler", "schedule"), ("runner", "pack"), ("engine", "_apply_computed"), ("engine", "_apply_tokens"))


def measure(compression: bool, args) -> dict:
    from zipage.engine import LLM
    from zipage.engine.config import SamplingParams

    llm = LLM(args.model, device="cpu", compression=compression, num_kv_blocks=8192, max_num_seqs=args.requests,
              max_cache_blocks_per_seq=args.budget_blocks, cpu_threads=1)
    engine = llm.engine
    owners = dict(scheduler=engine.scheduler, runner=engine.runner, engine=engine)
    spent = collections.defaultdict(float)
    for owner, name in PARTS:
        def timed(*a, _f=getattr(owners[owner], name), _name=name, **k):
            t = time.perf_counter()
            out = _f(*a, **k)
            spent[_name] += time.perf_counter() - t
            return out
        setattr(owners[owner], name, timed)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 100, ignore_eos=True)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(200) for _ in range(rng.randint(100, 300))], params)
    for _ in range(60):  # every prompt prefilled: the steps timed decode alone
        engine.step()
    spent.clear()
    for _ in range(args.steps):
        engine.step()
    decoding = len(engine.scheduler.running)
    compressions = sum(s.times_compressed for s in engine.scheduler.running)
    llm.close()
    return dict({name: spent[name] / args.steps * 1e3 for _, name in PARTS}, decoding=decoding,
                compressions=compressions)


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-tiny")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-blocks", type=int, default=64)
    args = bench_common.parse_args(parser, argv)
    torch.set_num_threads(1)
    runs = collections.defaultdict(list)
    for _ in range(args.rounds):
        for compression in (True, False):
            runs[compression].append(measure(compression, args))
    results = {**bench_common.device_description("cpu"), "args": vars(args), "modes": {}}
    for compression, rows in runs.items():
        label = "compressed" if compression else "full KV"
        summary = {name: statistics.median(r[name] for r in rows) for _, name in PARTS}
        summary["total_ms"] = sum(summary.values())
        summary["compressions"] = max(r["compressions"] for r in rows)
        summary["decoding"] = rows[0]["decoding"]
        results["modes"][label] = summary
        print(label, json.dumps({k: round(v, 3) for k, v in summary.items()}), flush=True)
    bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
