"""Why one request decodes slower on the CPU than transformers does: where a decode step's time goes.

    python benchmarks/cpu_one_request.py --threads 2      # SmolLM2, one 128-token prompt, 64 tokens
    python benchmarks/cpu_one_request.py --threads 1
    python benchmarks/cpu_one_request.py --weight-dtype float32 --engine-only   # the dequantized weights

Part 1 times one request through the engine, splitting each decode step into the model forward,
the decode attention inside it, and everything else on the host (scheduling, sampling,
bookkeeping). Part 2 times transformers' continuous batching on the same weights and request.
Part 3 times the CPU decode attention call alone at the engine's shapes. All with the engine's
intra-op threads: --threads, else its own choice (cpu_threads). The engine's weights follow --weight-dtype (auto: a quantized GGUF runs as stored,
docs/design-notes.md, "Quantized CPU weights"); --engine-only stops after part 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zipage.engine.config import DEFAULT_MODEL


def timed(fn, repeats: int = 50) -> float:
    """Median milliseconds of `fn()` over `repeats` calls, after one untimed call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def engine_breakdown(model: str, input_len: int, output_len: int, weight_dtype: str = "auto",
                     threads: int | None = None) -> None:
    from zipage.engine import LLM
    from zipage.engine.config import SamplingParams
    from zipage.engine.execution.models.decoder import Attention
    from zipage.cli.bench import random_prompts

    llm = LLM(model, device="cpu", num_kv_blocks=64, weight_dtype=weight_dtype, cpu_threads=threads)
    print(f"torch {torch.__version__}, {llm.engine.device_label} ({llm.engine.cpu_threads.why})")
    attention, forward = [], []
    decode_attention, launch = Attention._decode_attention, llm.engine.runner.launch

    def timed_attention(*args, **kwargs):  # either path: the native library's or the kernel seam's
        start = time.perf_counter()
        out = decode_attention(*args, **kwargs)
        attention.append(time.perf_counter() - start)
        return out

    def timed_launch(batch, *rest):  # on the CPU a launch runs the forward to the end
        start = time.perf_counter()
        out = launch(batch, *rest)
        if not batch.is_prefill:
            forward.append(time.perf_counter() - start)
        return out

    Attention._decode_attention, llm.engine.runner.launch = timed_attention, timed_launch
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(random_prompts(llm.engine.vocab_size, 1, input_len, seed=1), params)  # warm-up
    attention.clear(), forward.clear()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompt = random_prompts(llm.engine.vocab_size, 1, input_len, seed=2)
    engine = llm.engine
    engine.add_request(prompt[0], params)
    engine.step()  # prefill
    steps = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    layers = len(attention) // max(1, len(forward))
    Attention._decode_attention = decode_attention
    llm.close()
    step, fwd = statistics.median(steps), statistics.median(forward)
    print(f"engine, {model}, weight_dtype={weight_dtype}, 1 request, {input_len}-token prompt, "
          f"{len(steps)} decode steps (medians; best step {1000 * min(steps):.1f} ms):")
    print(f"  decode step {1000 * step:.1f} ms = forward {1000 * fwd:.1f} ms + host {1000 * (step - fwd):.1f} ms")
    if attention:
        print(f"  decode attention in the forward: {1000 * statistics.median(attention) * layers:.1f} ms ({layers} layers)")
    else:  # docs/design-notes.md, "Native CPU kernels"
        print("  decode attention: inside each layer's one native call, not timed apart")


def hf_one_request(model: str, input_len: int, output_len: int) -> None:
    from zipage.cli.bench import HFRunner, random_prompts
    from zipage.engine.config import EngineConfig

    runner = HFRunner(EngineConfig(model=model, device="cpu", num_kv_blocks=64))
    vocab = runner.model.config.vocab_size
    runner(random_prompts(vocab, 1, input_len, seed=1), 8, lambda tokens: None)  # warm-up
    result = runner(random_prompts(vocab, 1, input_len, seed=2), output_len, lambda tokens: None)
    print(f"transformers generate_batch, same request: {1000 * result['seconds'] / output_len:.1f} ms per token "
          f"(prefill included)")


def attention_alone(context: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
    from zipage.kernels.reference import paged_decode_attention

    width = -(-context // block_size)
    k_cache, v_cache = torch.randn(2, 64, block_size, kv_heads, head_dim)
    table = torch.arange(width, dtype=torch.int32)[None]
    query = torch.randn(1, q_heads, head_dim)
    lens = torch.tensor([context], dtype=torch.int32)
    samples = [timed(lambda: paged_decode_attention(query, k_cache, v_cache, table, lens, head_dim ** -0.5), 20)
               for _ in range(5)]
    print(f"decode attention call alone (1 query x {q_heads} heads over {context} entries, {kv_heads} KV heads), "
          f"medians of 5 x 20 calls: {', '.join(f'{ms:.3f}' for ms in samples)} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: the engine's choice, cpu_threads)")
    parser.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--engine-only", action="store_true", help="part 1 only")
    args = parser.parse_args()
    engine_breakdown(args.model, args.input_len, args.output_len, args.weight_dtype, args.threads)
    if args.engine_only:
        return
    hf_one_request(args.model, args.input_len, args.output_len)
    attention_alone(args.input_len + args.output_len // 2, 32, 9, 3, 64)  # SmolLM2-135M's attention shape


if __name__ == "__main__":
    main()
