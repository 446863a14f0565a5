"""How closely a model run on quantized CPU weights follows the same model dequantized to float32.

    python benchmarks/cpu_weight_agreement.py                          # SmolLM2, 24 chat prompts x 64 tokens
    python benchmarks/cpu_weight_agreement.py --modes auto,bfloat16 --json out.json

Each mode (a weight_dtype) generates every prompt's greedy continuation, one stream at a time, so
its decode steps run as they do in a chat (a quantized model's few-row products take the int4 path).
The float32-dequantized model then scores prompt + that continuation teacher-forced
(prompt_logprobs), so every position is judged on the same prefix: top-1 agreement = the share of
the mode's tokens that are float32's argmax too; the log-probability gap = |log p_mode - log
p_float32| of the mode's token. The share of prompts whose greedy text is exactly float32's, and the
mean length of the common prefix, are reported too.
"""

from __future__ import annotations

import statistics

import torch

from zipage.engine.config import DEFAULT_MODEL

import bench_common
from cpu_throughput import PROMPTS, chat_prompts

EXTRA_PROMPTS = [
    "List five animals that live in the desert.", "What is 17 times 23?", "Translate 'good morning' into French.",
    "Write a haiku about the sea.", "Who wrote Pride and Prejudice?", "Explain recursion to a child.",
    "What are the three states of matter?", "Give a recipe for pancakes.",
]


def scored(llm, prompt: list[int], continuation: list[int]) -> list:
    """The TokenLogprobs (with the top-1) of each continuation token under `llm`, teacher-forced."""
    from zipage.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1)
    out = llm.generate([prompt + continuation], params)[0]
    return out.prompt_logprobs[-len(continuation):]


def generated(llm, prompts: list[list[int]], output_len: int) -> list:
    """Each prompt's greedy output (ids, and each token's own log-probability), one request at a time."""
    from zipage.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=0)
    outs = [llm.generate([p], params)[0] for p in prompts]
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in outs]


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, DEFAULT_MODEL)
    bench_common.add_fixed_output_flags(parser, num_requests=24, output_len=64)
    parser.add_argument("--modes", default="auto,bfloat16", help="weight_dtype values to compare with float32")
    args = bench_common.parse_args(parser, argv)
    from zipage.engine import LLM

    reference = LLM(args.model, device="cpu", weight_dtype="float32", compression=False)
    prompts = chat_prompts(reference.tokenizer, args.num_requests, PROMPTS + EXTRA_PROMPTS)
    ref_out = [ids for ids, _ in generated(reference, prompts, args.output_len)]
    results = {"model": args.model, **bench_common.cpu_description(), "num_prompts": len(prompts),
               "output_len": args.output_len, "modes": {}}
    for mode in args.modes.split(","):
        llm = LLM(args.model, device="cpu", weight_dtype=mode, compression=False)
        outs = generated(llm, prompts, args.output_len)
        llm.close()
        agree, gaps, same, prefix = 0, [], 0, []
        for prompt, (ids, logprobs), ref in zip(prompts, outs, ref_out):
            judged = scored(reference, prompt, ids)
            agree += sum(next(iter(t.top)) == token for t, token in zip(judged, ids))
            gaps += [abs(mine - t.logprob) for mine, t in zip(logprobs, judged)]
            same += ids == ref
            prefix.append(next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref)))
        total = sum(len(ids) for ids, _ in outs)
        row = {"top1_agreement": agree / total, "positions": total,
               "logprob_gap_mean": statistics.mean(gaps), "logprob_gap_max": max(gaps),
               "greedy_identical": same / len(prompts), "greedy_common_prefix_mean": statistics.mean(prefix)}
        results["modes"][mode] = row
        print(f"{mode:9s} top-1 agreement {100 * row['top1_agreement']:.2f}% of {total} positions, "
              f"log-prob gap mean {row['logprob_gap_mean']:.4f} max {row['logprob_gap_max']:.3f}, "
              f"greedy text identical {same}/{len(prompts)}, common prefix {row['greedy_common_prefix_mean']:.1f} "
              f"of {args.output_len} tokens", flush=True)
        bench_common.write_json(args.json, results)
    reference.close()
    return results


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
