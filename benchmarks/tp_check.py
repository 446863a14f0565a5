"""Tensor parallelism against one rank: the same greedy tokens, compressed and full KV.

    python3 benchmarks/tp_check.py --device cuda --tp 2 --out DIR          # two GPUs, NCCL
    python benchmarks/tp_check.py --device cpu --model random:qwen3-tiny   # two CPU processes, gloo

For every mode it generates greedy continuations of random prompts with one rank and with --tp
ranks, and reports per request whether the tokens match and where they first differ. Float32 on
a CPU matches exactly; in bf16 on GPUs the all-reduce sums in another order than one GPU's matmul,
so a late divergence on a near-tie is possible and is reported, not hidden.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def generate(model: str, tp: int, compression: bool, prompts, max_tokens: int, engine_kwargs: dict):
    from zipage.engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, compression=compression, **engine_kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        compressions = llm.engine.totals["compressions"]
    finally:
        llm.close()
    return [o.token_ids for o in outs], compressions, time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--budget", type=int, default=2, help="max_cache_blocks_per_seq, small so compression runs")
    parser.add_argument("--out", default=None, help="write tp_check.json here")
    args = parser.parse_args(argv)

    from zipage.engine.loading.loader import resolve_model

    vocab = min(resolve_model(args.model).hf_config.vocab_size, 32000)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 300))] for _ in range(args.num_prompts)]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    engine_kwargs = dict(device=args.device, dtype=dtype, block_size=args.block_size,
                         max_cache_blocks_per_seq=args.budget)
    result = {"model": args.model, "device": args.device, "tp": args.tp, "dtype": dtype, "modes": {}}
    for compression in (False, True):
        one, c1, s1 = generate(args.model, 1, compression, prompts, args.max_tokens, engine_kwargs)
        many, cn, sn = generate(args.model, args.tp, compression, prompts, args.max_tokens, engine_kwargs)
        diffs = [first_difference(a, b) for a, b in zip(one, many)]
        mode = "zipage" if compression else "fullkv"
        result["modes"][mode] = {
            "requests_identical": sum(d is None for d in diffs), "requests": len(diffs),
            "first_difference": diffs, "compressions": [c1, cn], "seconds": [round(s1, 1), round(sn, 1)]}
        print(mode, json.dumps(result["modes"][mode]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tp_check.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
