"""Elastic budgets on a pool with room for every request: the same greedy tokens as full KV, at
full-KV speed. Serves one seeded workload (random prompts, long outputs, EOS ignored) with each
mode in turn, in one process, and compares every request's tokens against the first mode's.

    python3 benchmarks/elastic_identity.py --model random:qwen3-0.6b --num-requests 16 \\
        --min-output 4096 --max-output 16384 --modes fullkv,elastic,fixed --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import make_workload  # noqa: E402

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--modes", default="fullkv,elastic,fixed", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-input", type=int, default=128)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=4096)
    parser.add_argument("--max-output", type=int, default=16384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from zipage.engine.loading.loader import resolve_model

    vocab = resolve_model(args.model).hf_config.vocab_size
    prompts, outputs = make_workload(args.num_requests, args.min_input, args.max_input, args.min_output,
                                     args.max_output, min(vocab, 32000), args.seed)
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
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
