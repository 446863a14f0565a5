"""Elastic budgets on a pool with room for every request: the same greedy tokens as full KV, at
full-KV speed. Serves one seeded workload (random prompts, long outputs, EOS ignored) with each
mode in turn, in one process, and compares every request's tokens against the first mode's.

    python3 benchmarks/elastic_identity.py --model random:qwen3-0.6b --num-requests 16 \\
        --min-output 4096 --max-output 16384 --modes fullkv,elastic,fixed --json out.json
"""

from __future__ import annotations

import json
import time

import torch

import bench_common

MODES = {"fullkv": dict(compression=False), "fixed": dict(budget_policy="fixed"),
         "elastic": dict(budget_policy="elastic")}


def serve(model: str, prompts, outputs, knobs: dict) -> dict:
    from zipage.engine import LLM, SamplingParams

    llm = LLM(model, **knobs)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        totals = dict(llm.engine.totals)
        return dict(tokens=[o.token_ids for o in outs], seconds=seconds,
                    tok_per_s=sum(len(o.token_ids) for o in outs) / seconds,
                    compressions=totals["compressions"], preemptions=totals["preemptions"],
                    pool_blocks=llm.engine.blocks.num_blocks)
    finally:
        llm.close()


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-0.6b")
    parser.add_argument("--modes", default="fullkv,elastic,fixed", help=f"comma-separated, of {', '.join(MODES)}")
    bench_common.add_workload_flags(parser, num_requests=16, min_output=4096, max_output=16384, seed=1)
    parser.add_argument("--device", default="cuda")
    args = bench_common.parse_args(parser, argv)

    prompts, outputs = bench_common.workload(args)
    results = {"model": args.model, "args": vars(args), "total_output_tokens": sum(outputs), "modes": {}}
    reference = None
    for mode in args.modes.split(","):
        r = serve(args.model, prompts, outputs, dict(MODES[mode], device=args.device, seed=args.seed))
        tokens = r.pop("tokens")
        if reference is None:
            reference = tokens
        r["identical_to_first_mode"] = sum(a == b for a, b in zip(tokens, reference))
        results["modes"][mode] = r
        print(f"{mode}: {json.dumps(r)}", flush=True)
        bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
