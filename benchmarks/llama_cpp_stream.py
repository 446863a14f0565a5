"""llama.cpp (through llama-cpp-python) generating greedy tokens for given prompts, one stream at a time.

    python benchmarks/llama_cpp_stream.py --model FILE.gguf --prompts prompts.json --output-len 128

It imports only llama_cpp and the standard library, so it runs under any interpreter that has
llama-cpp-python (the `bench-llama` extra, or a venv of its own: cpu_throughput.py's --llama-python).
The prompts are token-id lists (the same ids every mode gets); each generates exactly --output-len
tokens (EOS ignored). Prints one JSON line: {"tokens": ..., "seconds": [one per repeat]}, timed from
the first prompt's evaluation to the last token, after one untimed run.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="a JSON file holding a list of token-id lists")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: its own choice)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from llama_cpp import Llama

    with open(args.prompts) as f:
        prompts = json.load(f)
    context = max(len(x) for x in prompts) + args.output_len + 8
    llm = Llama(model_path=args.model, n_ctx=context, n_threads=args.threads, n_batch=512, verbose=False)

    def once() -> int:
        produced = 0
        for prompt in prompts:
            llm.reset()
            for n, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True), start=1):
                if n == args.output_len:
                    break
            produced += n
        return produced

    once()  # warm-up
    seconds, tokens = [], 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = once()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"tokens": tokens, "seconds": seconds, "threads": llm.n_threads}))


if __name__ == "__main__":
    main()
