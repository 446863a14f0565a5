"""What structured output costs: the grammar's host work per token, and decode speed with and without
constrained requests in the batch.

    python benchmarks/structured_output.py --model random:qwen3-0.6b --device cuda
    python benchmarks/structured_output.py --model smollm2-135m --device cpu --batch 1,4

For each batch size: the tokens per second of a batch of free requests, of the same batch with one
request under a JSON schema, and of a batch all under the schema. A free request's steps never change
when nobody asks; a batch with a constrained request is not overlapped (its mask needs each token) and
pays the mask. Also the llguidance tokenizer's build time, a schema's compile time and the host mask
time per token (median), measured on this machine's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench_common import cpu_description, device_description, parse_args, parser, write_json

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "notes"],
          "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}}}


def grammar_host_costs(llm, tokens: int) -> dict:
    """Build the tokenizer, compile the schema, then time the mask of each token of a valid answer."""
    from zipage.engine.execution.grammar_masks import fill_bitmasks

    grammars = llm.engine.grammars
    started = time.perf_counter()
    grammar = grammars.compile(SCHEMA)  # the first compile builds the tokenizer
    first = time.perf_counter() - started
    started = time.perf_counter()
    grammar = grammars.compile(SCHEMA)
    compile_ms = 1e3 * (time.perf_counter() - started)
    text = json.dumps({"title": "Notes on the engine", "notes": ["a bounded cache " * 8] * 8})
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    times = []
    for token in ids:
        started = time.perf_counter()
        fill_bitmasks([grammar], llm.engine.vocab_size, pin=False)
        times.append(time.perf_counter() - started)
        if grammar.accept(token) is not None:
            break
    return {"tokenizer_and_first_compile_s": round(first, 3), "compile_ms": round(compile_ms, 2),
            "mask_us_median": round(1e6 * statistics.median(times), 1), "mask_us_max": round(1e6 * max(times), 1),
            "tokens": len(times)}


def decode_rate(llm, batch: int, constrained: int, max_tokens: int) -> dict:
    from zipage.engine import SamplingParams

    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    shaped = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=SCHEMA)
    prompts = [f"Write the notes of meeting {i} as JSON." for i in range(batch)]
    params = [shaped] * constrained + [free] * (batch - constrained)
    llm.generate(prompts, params)  # warm
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    return {"batch": batch, "constrained": constrained, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 1)}


def main(argv=None) -> None:
    p = parser(__doc__, "random:qwen3-0.6b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--batch", default="1,32", help="batch sizes, comma-separated")
    p.add_argument("--max-tokens", type=int, default=256)
    args = parse_args(p, argv)
    from zipage.engine import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, compression=False)
    where = device_description(args.device) if args.device != "cpu" else cpu_description()
    result = {"hardware": where, "model": args.model, "host": grammar_host_costs(llm, 200), "decode": []}
    print(json.dumps(result["host"]), flush=True)
    for batch in (int(b) for b in args.batch.split(",")):
        for constrained in dict.fromkeys([0, 1, batch]):
            row = decode_rate(llm, batch, constrained, args.max_tokens)
            result["decode"].append(row)
            print(json.dumps(row), flush=True)
            write_json(args.json, result)
    llm.close()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
