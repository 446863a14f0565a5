"""CPU throughput: Zipage against transformers' `generate` (static padded batch) and
`generate_batch` (continuous batching), in one process, on the same weights, and llama.cpp on the
same GGUF file.

    python benchmarks/cpu_throughput.py                 # 16 chat prompts x 128 greedy tokens, SmolLM2
    python benchmarks/cpu_throughput.py --json out.json
    python benchmarks/cpu_throughput.py --num-requests 1 --modes zipage,zipage-float32,hf-generate,llama-cpp \
        --llama-python /tmp/venv-llama/bin/python     # one stream; llama.cpp from a venv of its own

Every mode generates exactly --output-len tokens per prompt (EOS ignored), greedy (Zipage's modes
sample instead at --temperature and --top-p when given, as a chat does), in --dtype
(float32 by default; bfloat16 uses the CPU's bf16 matrix units where it has them). Zipage's weights
follow --weight-dtype ("auto": a quantized GGUF runs as stored, docs/design-notes.md, "Quantized CPU
weights"); mode zipage-float32 is Zipage with every weight dequantized to float32. Mode llama-cpp runs
benchmarks/llama_cpp_stream.py under --llama-python (llama-cpp-python: the bench-llama extra), one
stream at a time, and times only its generation (not its start or load).
Throughput = generated tokens / wall time of the whole batch (prefill included). Each mode runs
once untimed (warm-up), then the modes take turns for --repeats rounds (so load from other
processes on a shared CPU falls on all of them alike); the median of each mode is reported.
"""

from __future__ import annotations

import statistics
import sys
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


def chat_prompts(tokenizer, n: int, texts: list[str] = PROMPTS) -> list[list[int]]:
    prompts = [texts[i % len(texts)] for i in range(n)]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for p in prompts]


def run_zipage(llm, prompts, output_len: int, temperature: float = 0.0, top_p: float = 1.0):
    """Greedy, or sampled at this temperature and top-p with a seed per prompt (the same tokens each round)."""
    from zipage.engine import SamplingParams

    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i if temperature else None,
                             max_tokens=output_len, ignore_eos=True) for i in range(len(prompts))]

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


def run_llama_cpp(python: str, gguf: str, prompts, output_len: int):
    """llama.cpp on the same GGUF and prompt ids, in a child process under `python`; a run returns
    (tokens, seconds of generation alone)."""
    import json
    import os
    import subprocess
    import tempfile

    if not gguf.endswith(".gguf"):
        raise SystemExit(f"mode llama-cpp needs a GGUF model, not {gguf!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_stream.py")

    def once():
        cmd = [python, script, "--model", gguf, "--prompts", f.name, "--output-len", str(output_len),
               "--threads", str(torch.get_num_threads()), "--repeats", "1"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"llama-cpp mode failed (is llama-cpp-python installed for {python}?):\n{out.stderr}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return result["tokens"], result["seconds"][0]

    return once


def interleaved(runs: dict, repeats: int) -> dict:
    """Warm every mode up once, then time them in turns (A, B, C, A, B, C, ...), so a busy shared
    CPU slows every mode alike; the median of each mode's runs. A run returns its token count, or
    (tokens, seconds) when it times itself (llama-cpp: a child process's start is not its speed)."""
    for once in runs.values():
        once()
    times = {mode: [] for mode in runs}
    tokens = {}
    for _ in range(repeats):
        for mode, once in runs.items():
            start = time.perf_counter()
            result = once()
            elapsed = time.perf_counter() - start
            tokens[mode], seconds = result if isinstance(result, tuple) else (result, elapsed)
            times[mode].append(seconds)
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
    parser.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="Zipage's weight_dtype (modes zipage and fullkv)")
    parser.add_argument("--llama-python", default=sys.executable, help="interpreter with llama-cpp-python")
    parser.add_argument("--temperature", type=float, default=0.0, help="Zipage's modes sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="and this top-p")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for every mode (default: the engine's choice, cpu_threads)")
    args = bench_common.parse_args(parser, argv)

    modes = args.modes.split(",")
    from zipage.engine import LLM

    weights = dict(weight_dtype=args.weight_dtype)  # "float32" / "bfloat16" must match --dtype
    # The first engine sets the process's threads; the other modes run on them.
    llm = LLM(args.model, device="cpu", dtype=args.dtype, compression=True, cpu_threads=args.threads, **weights)
    results = {"model": args.model, "num_requests": args.num_requests, "output_len": args.output_len,
               **bench_common.cpu_description(), "modes": {}}
    results["dtype"], results["weight_dtype"] = args.dtype, args.weight_dtype
    prompts = chat_prompts(llm.tokenizer, args.num_requests)
    results["prompt_tokens"] = [len(p) for p in prompts]
    hf = None
    runs = {}
    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    results["sampling"] = sampling
    for mode in modes:
        if mode == "zipage":
            runs[mode] = run_zipage(llm, prompts, args.output_len, **sampling)
        elif mode == "fullkv":
            runs[mode] = run_zipage(LLM(args.model, device="cpu", dtype=args.dtype, compression=False, **weights),
                                    prompts, args.output_len, **sampling)
        elif mode == "zipage-float32":
            runs[mode] = run_zipage(LLM(args.model, device="cpu", dtype="float32", weight_dtype="float32",
                                        compression=True), prompts, args.output_len, **sampling)
        elif mode == "llama-cpp":
            runs[mode] = run_llama_cpp(args.llama_python, llm.engine.source.path, prompts, args.output_len)
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
