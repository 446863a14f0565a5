"""Decode-step times on the CPU for a SmolLM2-shaped GGUF of random weights, by batch and product form.

    python benchmarks/cpu_decode_steps.py --threads 2                      # the forms the engine picks
    python benchmarks/cpu_decode_steps.py --threads 2 --forms auto,avx2 --repeats 2
    python benchmarks/cpu_decode_steps.py --threads 2 --forms auto,int4 --qtype Q4_0

For machines without the model file (a GPU host's CPU, say): the weights are random, the shapes
SmolLM2-135M's (30 layers, 576 wide, 49k-row tied Q8_0 head), so a step reads the bytes the real
model's does. Each batch of 64-token prompts decodes 40 greedy tokens with its requests in step; the
median step after the first few is reported. Forms (docs/design-notes.md, "Native CPU kernels"):
`auto` what the engine runs here; `avx2` the native kernels built without their AVX-512 products (on
an AVX-512 CPU); `int4` as without a C compiler (PyTorch's int4 kernel, float16 copies). Each form runs
in its own process, the forms alternating over --repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)


def choose_form(form: str) -> None:
    """Make this process run `form` in place of what the engine would pick (see the docstring)."""
    from zipage.engine.execution.models import quantized
    from zipage.engine.loading.loader import c_compiler, cache_dir
    from zipage.kernels.cpu.native import NativeLibrary, build

    if form == "avx2":  # the same source without its AVX-512 products, as benchmarks/cpu_int4_kernel.py builds it
        library = NativeLibrary(build(cache_dir() / "native-avx2", c_compiler(), defines=("ZQ_NO_AVX512",)))
        quantized.native_kernel = lambda: (library, None)
    elif form == "int4":
        quantized.native_kernel = lambda: (None, "switched off by the benchmark")


def run_form(form: str, path: str, threads: int, batches: list[int]) -> None:
    choose_form(form)
    from zipage.engine import EngineConfig, SamplingParams
    from zipage.engine.core.engine_core import EngineCore
    from zipage.testing import gguf_source

    core = EngineCore(EngineConfig(model=path, device="cpu", compression=False, block_size=16, num_kv_blocks=512,
                                   weight_dtype="auto", mixed_steps=False, cpu_threads=threads),
                      gguf_source(smollm2_config(), path))
    report = core.runner.model.weight_report
    print(f"{form}: {report.summary()}")
    for batch in batches:
        for i in range(batch):
            core.add_request(list(range(3 + i, 67 + i)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        times = []
        while core.has_work():
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        step = 1000 * statistics.median(times[3:])  # past the prefill and the first decode steps
        print(f"{form:5s} batch {batch:2d}: decode step {step:6.2f} ms  {batch / step * 1000:6.1f} tok/s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--forms", default="auto", help="comma-separated: auto, avx2, int4")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--qtype", default="Q4_1", help="the layers' GGUF type (the head is Q8_0)")
    p.add_argument("--gguf", default=None, help="a file written by an earlier run (else one is written)")
    p.add_argument("--only-form", default=None, help=argparse.SUPPRESS)  # a child process's one form
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.only_form:
        run_form(args.only_form, args.gguf, args.threads, batches)
        return
    from zipage.testing import write_gguf

    path = args.gguf or write_gguf(smollm2_config(), args.qtype, seed=1, embedding="Q8_0")
    cache = tempfile.mkdtemp(prefix="zipage-bench-cache-")  # the file's converted copy and forms go here
    try:
        for _ in range(args.repeats):
            for form in args.forms.split(","):
                subprocess.run([sys.executable, __file__, "--only-form", form, "--gguf", path, "--threads",
                                str(args.threads), "--batches", args.batches], check=True,
                               env={**os.environ, "ZIPAGE_CACHE": cache})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if args.gguf is None:
            os.unlink(path)


if __name__ == "__main__":
    main()
