"""What compression's GPU work costs a loaded decode step: the same engine, steady under memory
pressure, timed with its compressions run and with their tensor work skipped.

    python3 benchmarks/gpu_compression_cost.py --model random:qwen3-0.6b --kv-cache-dtypes auto,int8 \\
        --num-requests 128 --kv-cache-gb 12 --json out.json

The workload is gpu_throughput.py's (prompts of 128-512 random tokens, outputs of --min-output ..
--max-output, EOS ignored, a budget of 8 blocks of 256). After --warm-steps steps every running
request is at its budget and compresses once per block it fills; then --rounds rounds each time
--steps steps with compression on and --steps with its tensor work skipped (the requests still
compress on schedule: blocks are planned and released, only the scoring and compaction kernels do
not run, so what is left in their KV is stale and the tokens mean nothing). The difference is
compression's cost to a step, concurrency with decoding included, which a kernel table cannot
show: compression runs on its own stream beside the decode steps. Timing only.
"""

from __future__ import annotations

import gc
import json
import time

import torch

import bench_common


def timed_steps(engine, steps: int) -> dict:
    generated, compressions = engine.totals["generated_tokens"], engine.totals["compressions"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = engine.totals["generated_tokens"] - generated
    return {"ms_per_step": 1e3 * seconds / steps, "tokens_per_step": tokens / steps, "tok_per_s": tokens / seconds,
            "compressions": engine.totals["compressions"] - compressions, "running": len(engine.scheduler.running)}


def measure(args, prompts, outputs, kv_cache_dtype: str, log) -> dict:
    from zipage.engine.config import EngineConfig, SamplingParams
    from zipage.engine.core.engine_core import EngineCore

    engine = EngineCore(EngineConfig(model=args.model, device="cuda", block_size=args.block_size,
                                     max_cache_blocks_per_seq=args.budget, kv_cache_gb=args.kv_cache_gb,
                                     kv_cache_dtype=kv_cache_dtype))
    try:
        for prompt, n in zip(prompts, outputs):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for _ in range(args.warm_steps):
            engine.step()
        if not engine.scheduler.waiting:
            raise SystemExit("the waiting queue emptied during the warm-up: more requests or fewer warm steps")
        compress = engine.compressor.run_work
        rounds = []
        for _ in range(args.rounds):
            row = {"with": timed_steps(engine, args.steps)}
            engine.compressor.run_work = lambda **work: None  # planned and landed, no tensor work
            try:
                row["without"] = timed_steps(engine, args.steps)
            finally:
                engine.compressor.run_work = compress
            log(f"  {kv_cache_dtype}: {json.dumps(row)}")
            rounds.append(row)
        mean = {side: sum(r[side]["ms_per_step"] for r in rounds) / len(rounds) for side in ("with", "without")}
        compressions = sum(r["with"]["compressions"] for r in rounds) / (len(rounds) * args.steps)
        return {"rounds": rounds, "kv_blocks": engine.blocks.num_blocks, "ms_per_step": mean,
                "compression_ms_per_step": mean["with"] - mean["without"],
                "compressions_per_step": compressions,
                "ms_per_compression": (mean["with"] - mean["without"]) / compressions if compressions else None}
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-0.6b")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8", help="comma-separated: auto, fp8, int8")
    bench_common.add_workload_flags(parser, num_requests=128, min_output=4096, max_output=16384, seed=0)
    parser.add_argument("--kv-cache-gb", type=float, default=12.0)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--budget", type=int, default=8, help="max_cache_blocks_per_seq")
    parser.add_argument("--warm-steps", type=int, default=3000,
                        help="steps before timing (enough for every running request to reach its budget)")
    parser.add_argument("--steps", type=int, default=300, help="steps timed each way in a round")
    parser.add_argument("--rounds", type=int, default=2)
    args = bench_common.parse_args(parser, argv)
    prompts, outputs = bench_common.workload(args)
    results = {"model": args.model, **bench_common.device_description("cuda"), "args": vars(args), "caches": {}}
    log = lambda line: print(line, flush=True)  # noqa: E731
    for dtype in args.kv_cache_dtypes.split(","):
        log(f"{args.model} {dtype} ...")
        results["caches"][dtype] = measure(args, prompts, outputs, dtype, log)
        log(f"{args.model} {dtype}: " + json.dumps({k: v for k, v in results["caches"][dtype].items() if k != "rounds"}))
        bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
