"""Bounded KV per request: peak blocks per request and peak concurrency, compressed vs full KV,
at one fixed pool, on CPU.

    python benchmarks/cpu_memory.py                       # 64 requests x 2048 tokens, SmolLM2
    python benchmarks/cpu_memory.py --model random:llama-tiny --json out.json

Every request is admitted at once and generates exactly --output-len tokens (EOS ignored).
The pool is the same number of blocks for both modes; each step records how many requests run
and how many blocks each holds.
"""

from __future__ import annotations

import json
import time

from zipage.engine.config import DEFAULT_MODEL, EngineConfig, SamplingParams
from zipage.engine.core.engine_core import EngineCore
from zipage.engine.loading.loader import resolve_model

import bench_common

PROMPT = "Think step by step and explain, in detail, how long division works, with three worked examples."


def measure(source, compression: bool, args) -> dict:
    engine = EngineCore(EngineConfig(
        model=source.name, device="cpu", compression=compression, block_size=args.block_size,
        max_cache_blocks_per_seq=args.budget, window=args.window, num_kv_blocks=args.pool_blocks,
        max_num_seqs=args.num_requests), source=source)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        # A different request number up front keeps whole prompts from being shared by the prefix cache.
        ids = engine.apply_chat_template([{"role": "user", "content": f"Request {i}. {PROMPT}"}])
        engine.add_request(ids, params)
    peak_running = peak_blocks = peak_compressed_blocks = 0
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
        running = engine.scheduler.running
        peak_running = max(peak_running, len(running))
        for seq in running:
            peak_blocks = max(peak_blocks, len(seq.block_table))
            if seq.is_compressed:
                peak_compressed_blocks = max(peak_compressed_blocks, len(seq.block_table))
    seconds = time.perf_counter() - start
    result = {
        "mode": "zipage" if compression else "fullkv", "pool_blocks": engine.blocks.num_blocks,
        "peak_concurrency": peak_running, "peak_blocks_per_request": peak_blocks,
        "peak_blocks_per_compressed_request": peak_compressed_blocks,
        "preemptions": engine.totals["preemptions"], "compressions": engine.totals["compressions"],
        "generated_tokens": engine.totals["generated_tokens"], "seconds": round(seconds, 1),
        "tok_per_s": engine.totals["generated_tokens"] / seconds,
        # mean requests served per forward pass: concurrency where it counts, over the whole run
        "mean_tokens_per_forward": engine.totals["generated_tokens"] / max(engine.step_count, 1),
    }
    engine.close()
    return result


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, DEFAULT_MODEL)
    bench_common.add_fixed_output_flags(parser, num_requests=64, output_len=2048)
    parser.add_argument("--pool-blocks", type=int, default=400)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--modes", default="zipage,fullkv")
    args = bench_common.parse_args(parser, argv)
    source = resolve_model(args.model)
    results = {"model": args.model, "args": vars(args), "modes": {}}
    for mode in args.modes.split(","):
        r = measure(source, mode == "zipage", args)
        results["modes"][mode] = r
        print(json.dumps(r), flush=True)
        bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
