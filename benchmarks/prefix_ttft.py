"""Time to first token of a request whose long prefix an earlier, compressed request already served.

Request A (a shared prefix plus its own suffix) runs to the end and is compressed on the way; then
request B (the same prefix plus another suffix) arrives. With the prefix cache surviving
compression, B is served the prefix from the cache and prefills only its suffix (and the window).
The script reports B's time to first token and how many prompt tokens the cache served, against a
run with `prefix_caching=False` (the whole prompt prefilled), repeated and interleaved.

    python benchmarks/prefix_ttft.py                                  # SmolLM2 on the CPU
    python benchmarks/prefix_ttft.py --model random:qwen3-8b --device cuda --block-size 256 --budget-blocks 4 \
        --kv-cache-gb 16
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from zipage import LLM, SamplingParams
from zipage.engine.config import DEFAULT_MODEL


def make_llm(args, prefix_caching: bool) -> LLM:
    return LLM(args.model, device=args.device, block_size=args.block_size, max_cache_blocks_per_seq=args.budget_blocks,
               prefix_caching=prefix_caching, max_num_batched_tokens=args.chunk, kv_cache_gb=args.kv_cache_gb)


def run_once(llm: LLM, args, seed: int) -> dict:
    """A, then B with A's prefix; fresh random tokens per seed, so no run hits an earlier one's cache."""
    gen = torch.Generator().manual_seed(seed)
    high = min(llm.engine.vocab_size, 30000)
    prefix = torch.randint(100, high, (args.prefix_len,), generator=gen).tolist()
    suffix_a, suffix_b = (torch.randint(100, high, (16,), generator=gen).tolist() for _ in range(2))
    a = llm.generate(prefix + suffix_a, SamplingParams(temperature=0, max_tokens=args.a_tokens, ignore_eos=True))[0]
    b = llm.generate(prefix + suffix_b, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return {"ttft_s": b.metrics["first_token"] - b.metrics["arrival"],
            "cached_prompt_tokens": b.metrics["cached_prompt_tokens"],
            "a_times_compressed": a.metrics["times_compressed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--budget-blocks", type=int, default=32, help="budget n in blocks (32 x 32 = 1024 tokens)")
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--a-tokens", type=int, default=8, help="tokens request A generates")
    parser.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="KV pool of each engine (both live at once; set it on a GPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = {True: [], False: []}
    engines = {flag: make_llm(args, flag) for flag in (True, False)}
    try:
        run_once(engines[True], args, seed=10_000)  # warm-up, on prefixes of its own
        run_once(engines[False], args, seed=10_001)
        for r in range(args.repeats):
            for prefix_caching in (True, False):  # interleaved, so drift hits both alike
                rows[prefix_caching].append(run_once(engines[prefix_caching], args, seed=r))
    finally:
        for llm in engines.values():
            llm.close()
    summary = {}
    for prefix_caching, runs in rows.items():
        name = "prefix cache" if prefix_caching else "no prefix cache"
        ttft = [x["ttft_s"] for x in runs]
        summary[name] = {"ttft_median_s": statistics.median(ttft), "ttft_min_s": min(ttft), "ttft_max_s": max(ttft),
                         "cached_prompt_tokens": runs[0]["cached_prompt_tokens"],
                         "a_times_compressed": runs[0]["a_times_compressed"]}
        print(f"{name:16s} B's TTFT median {statistics.median(ttft):.3f} s (min {min(ttft):.3f}, max {max(ttft):.3f}); "
              f"served from cache: {runs[0]['cached_prompt_tokens']} of {args.prefix_len + 16} prompt tokens; "
              f"A compressed {runs[0]['a_times_compressed']} times")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": {str(k): v for k, v in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
