"""CPU throughput: Zipage against transformers' `generate` (static padded batch) and
`generate_batch` (continuous batching), in one process, on the same weights.

    python benchmarks/cpu_throughput.py                 # 16 chat prompts x 128 greedy tokens, SmolLM2
    python benchmarks/cpu_throughput.py --json out.json

Every mode generates exactly --output-len tokens per prompt (EOS ignored), greedy, in --dtype
(float32 by default; bfloat16 uses the CPU's bf16 matrix units where it has them).
Throughput = generated tokens / wall time of the whole batch (prefill included). Each mode runs
once untimed (warm-up), then the modes take turns for --repeats rounds (so load from other
processes on a shared CPU falls on all of them alike); the median of each mode is reported.
"""

from __future__ import annotations

import statistics
import time

import torch

from zipage.engine.config import DEFAULT_MODEL

import bench_common

PROMPTS = [
    "Explain how a hash map works.", "Write a short poem about autumn.", "What causes the tides?",
    "Give three tips for learning a new language.", "How does a bicycle stay upright?",
    "Summarise the plot of Romeo and Juliet.", "Why is the ocean salty?", "What is a prime number?",
    "Describe the water cycle.", "How do vaccines work?", "What is the difference between a list and a tuple in Python?",
    "Why do cats purr?", "How is glass made?", "What does a CPU cache do?", "Explain photosynthesis simply.",
    "How do airplanes fly?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for p in prompts]


def run_zipage(llm, prompts, output_len: int):
    from zipage.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def once():
        return sum(len(o.token_ids) for o in llm.generate(prompts, params))

    return once


def hf_model(llm, dtype: torch.dtype):
    """The transformers model on the very weights the engine loaded."""
    from transformers import AutoModelForCausalLM

    path = llm.engine.source.path
    if path.endswith(".gguf"):
        import os
        folder, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_hf_generate(model, tokenizer, prompts, output_len: int):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    @torch.inference_mode()
    def once():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(prompts)

    return once


def run_hf_generate_batch(model, prompts, output_len: int):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=model.generation_config.eos_token_id,
                              pad_token_id=model.generation_config.pad_token_id or 0)

    @torch.inference_mode()
    def once():
        results = model.generate_batch(inputs=prompts, generation_config=config)
        return sum(len(r.generated_tokens) for r in results.values())

    return once


def interleaved(runs: dict, repeats: int) -> dict:
    """Warm every mode up once, then time them in turns (A, B, C, A, B, C, ...), so a busy shared
    CPU slows every mode alike; the median of each mode's runs."""
    for once in runs.values():
        once()
    times = {mode: [] for mode in runs}
    tokens = {}
    for _ in range(repeats):
        for mode, once in runs.items():
            start = time.perf_counter()
            tokens[mode] = once()
            times[mode].append(time.perf_counter() - start)
    out = {}
    for mode in runs:
        seconds = statistics.median(times[mode])
        out[mode] = {"seconds": seconds, "tokens": tokens[mode], "tok_per_s": tokens[mode] / seconds,
                     "runs_s": [round(t, 3) for t in times[mode]]}
    return out


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, DEFAULT_MODEL)
    bench_common.add_fixed_output_flags(parser, num_requests=16, output_len=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="zipage,fullkv,hf-generate,hf-generate-batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for every mode (default: torch's choice)")
    args = bench_common.parse_args(parser, argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    results = {"model": args.model, "num_requests": args.num_requests, "output_len": args.output_len,
               **bench_common.cpu_description(), "modes": {}}
    modes = args.modes.split(",")
    from zipage.engine import LLM

    llm = LLM(args.model, device="cpu", dtype=args.dtype, compression=True)
    results["dtype"] = args.dtype
    prompts = chat_prompts(llm.tokenizer, args.num_requests)
    results["prompt_tokens"] = [len(p) for p in prompts]
    hf = None
    runs = {}
    for mode in modes:
        if mode == "zipage":
            runs[mode] = run_zipage(llm, prompts, args.output_len)
        elif mode == "fullkv":
            runs[mode] = run_zipage(LLM(args.model, device="cpu", dtype=args.dtype, compression=False), prompts,
                                    args.output_len)
        elif mode == "hf-generate":
            hf = hf or hf_model(llm, getattr(torch, args.dtype))
            runs[mode] = run_hf_generate(hf, llm.tokenizer, prompts, args.output_len)
        elif mode == "hf-generate-batch":
            hf = hf or hf_model(llm, getattr(torch, args.dtype))
            runs[mode] = run_hf_generate_batch(hf, prompts, args.output_len)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    results["modes"] = interleaved(runs, args.repeats)
    for mode, r in results["modes"].items():
        print(f"{mode:18s} {r['tok_per_s']:8.1f} tok/s  ({r['tokens']} tokens in {r['seconds']:.2f} s)", flush=True)
    if "hf-generate" in results["modes"]:
        base = results["modes"]["hf-generate"]["tok_per_s"]
        results["over_hf_generate"] = {m: r["tok_per_s"] / base for m, r in results["modes"].items()}
        print("over hf-generate: " + ", ".join(f"{m} {x:.2f}x" for m, x in results["over_hf_generate"].items()))
    bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
