"""Prefill attention at the compute limit: the paged Triton kernel against torch's SDPA (flash).

For each shape (a fresh causal prompt, or a chunk of new tokens on a long cached prefix), the
kernel reads keys and values through a shuffled block table of 256-token blocks; SDPA gets the
same keys and values contiguous, with the causal mask aligned to the last query (a chunk's rows
see the whole prefix). Every launch shape given is checked against SDPA (relative error) before
it is timed; the table gives TFLOP/s (causal pairs only) and the share of SDPA's rate.

    python3 benchmarks/gpu_prefill_attention.py [--sweep] [--json out.json]

--sweep times a list of launch shapes besides the default the kernel picks, to choose that
default; `--ttft MODEL` also times one prompt's first token through the engine and through
transformers' forward (sdpa) on the same random weights.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import device_description, parse_args, parser, write_json  # noqa: E402

from zipage.kernels import triton_attention as tatt  # noqa: E402

BLOCK = 256
# (name, query heads, kv heads, head dim, new tokens, cached prefix)
SHAPES = [
    ("8k", 32, 8, 128, 8192, 0),
    ("32k", 32, 8, 128, 32768, 0),
    ("4k on 32k", 32, 8, 128, 4096, 28672),
    ("2k on 16k", 32, 8, 128, 2048, 14336),
    ("8k D64", 16, 4, 64, 8192, 0),
    ("4k on 32k D64", 16, 4, 64, 4096, 28672),
]
T = tatt.PrefillTiles
SWEEP = [
    T(64, 64, 8, 2), T(128, 128, 8, 2), T(128, 128, 8, 2, tma=True), T(128, 128, 8, 3, tma=True),
    T(128, 128, 8, 3, tma=True, heads_fast=True), T(128, 64, 8, 3, tma=True), T(128, 64, 8, 4, tma=True),
    T(64, 64, 4, 3, tma=True), T(64, 64, 4, 4, tma=True), T(64, 128, 4, 3, tma=True), T(128, 64, 4, 3, tma=True),
    T(64, 64, 4, 3, tma=True, heads_fast=True),
]


def causal_pairs(new: int, prefix: int) -> int:
    return new * prefix + new * (new + 1) // 2


def make_case(q_heads, kv_heads, head_dim, new, prefix, gen):
    total = new + prefix
    num_blocks = triton.cdiv(total, BLOCK)
    dev = "cuda"
    k = torch.randn(total, kv_heads, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    v = torch.randn(total, kv_heads, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    q = torch.randn(new, q_heads, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks + 3, generator=gen, device=dev)[:num_blocks]  # a shuffled pool
    k_cache = torch.randn(num_blocks + 3, BLOCK, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    pad = num_blocks * BLOCK - total
    k_cache[perm] = torch.cat([k, k.new_zeros(pad, kv_heads, head_dim)]).view(num_blocks, BLOCK, kv_heads, head_dim)
    v_cache[perm] = torch.cat([v, v.new_zeros(pad, kv_heads, head_dim)]).view(num_blocks, BLOCK, kv_heads, head_dim)
    table = perm.to(torch.int32).view(1, -1)
    cu = torch.tensor([0, new], dtype=torch.int32, device=dev)
    lens = torch.tensor([total], dtype=torch.int32, device=dev)
    return (q, k_cache, v_cache, table, cu, lens, head_dim ** -0.5), (q, k, v)


def sdpa(q, k, v, new, prefix):
    """Torch's fused attention on contiguous K/V; the causal mask ends at the last query."""
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1)[None].repeat_interleave(group, 1)
    vh = v.transpose(0, 1)[None].repeat_interleave(group, 1)
    if prefix == 0:
        return lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    mask = causal_lower_right(new, new + prefix)
    return lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def attention_rows(shapes_to_time, sweep: bool, gen, before=None) -> list[dict]:
    rows = []
    for name, hq, hkv, d, new, prefix in SHAPES:
        if shapes_to_time and name not in shapes_to_time:
            continue
        kernel_args, (q, k, v) = make_case(hq, hkv, d, new, prefix, gen)
        flops = 4 * hq * d * causal_pairs(new, prefix)
        ref_fn = sdpa(q, k, v, new, prefix)
        ref = ref_fn()[0].transpose(0, 1)
        sdpa_ms = time_ms(ref_fn)
        row = dict(shape=name, q_heads=hq, kv_heads=hkv, head_dim=d, new=new, prefix=prefix,
                   sdpa_ms=sdpa_ms, sdpa_tflops=flops / sdpa_ms / 1e9, variants=[])
        picked = tatt.prefill_tiles(new, d, q.device, q.element_size())
        if before is not None:
            fn = lambda: before.prefill_attention(*kernel_args)  # noqa: E731
            err = rel_err(fn(), ref)
            ms = time_ms(fn)
            row["before"] = dict(err=err, ms=ms, tflops=flops / ms / 1e9)
            print(f"{name:>14}: before {flops / ms / 1e9:6.1f} TFLOP/s (err {err:.1e})", flush=True)
        candidates = [("default", picked)] + ([(str(i), t) for i, t in enumerate(SWEEP)] if sweep else [])
        for label, tiles in candidates:
            try:
                fn = lambda tiles=tiles: tatt.prefill_attention_impl(*kernel_args, tiles=tiles)  # noqa: E731
                out = fn()
                err = rel_err(out, ref)
                ok = bool(torch.isfinite(out).all()) and err < 2e-2
                ms = time_ms(fn) if ok else float("nan")
                row["variants"].append(dict(label=label, tiles=asdict(tiles), err=err, ok=ok, ms=ms,
                                            tflops=flops / ms / 1e9 if ok else 0.0))
            except Exception as exc:  # a shape the compiler refuses (shared memory) is reported, not fatal
                row["variants"].append(dict(label=label, tiles=asdict(tiles), ok=False, error=repr(exc)[:300]))
        rows.append(row)
        best = max((x for x in row["variants"] if x.get("ok")), key=lambda x: x["tflops"], default=None)
        default = row["variants"][0]
        print(f"{name:>14}: SDPA {row['sdpa_tflops']:6.1f} TFLOP/s | default {default.get('tflops', 0):6.1f}"
              f" ({default.get('tflops', 0) / row['sdpa_tflops']:.0%}, err {default.get('err', float('nan')):.1e})"
              + (f" | best {best['label']} {best['tflops']:6.1f} {best['tiles']}" if best else ""), flush=True)
        del kernel_args, q, k, v, ref
        torch.cuda.empty_cache()
    return rows


def ttft_rows(model: str, prompt_lens: list[int]) -> list[dict]:
    """One prompt's first token: the engine (LLM.generate, max_tokens=1) and transformers' forward."""
    from transformers import AutoModelForCausalLM

    from zipage import LLM, SamplingParams
    from zipage.engine.loading.loader import resolve_model

    rows = []
    longest = max(prompt_lens)
    llm = LLM(model, max_model_len=longest + 64, max_num_batched_tokens=4096)
    hf_config = resolve_model(model).hf_config
    gen = torch.Generator().manual_seed(0)
    engine_s = {}
    for n in prompt_lens:
        times = []
        for _ in range(4):  # a fresh prompt each time: nothing comes from the prefix cache
            ids = torch.randint(0, min(hf_config.vocab_size, 32000), (n,), generator=gen).tolist()
            start = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            times.append(time.perf_counter() - start)
        engine_s[n] = sorted(times[1:])[1]  # the first run warms up
        print(f"TTFT {n}: engine {engine_s[n]:.3f} s (median of 3 after one warm-up)", flush=True)
    del llm
    torch.cuda.empty_cache()
    with torch.device("cuda"):  # random weights made on the GPU: an 8B model inits in seconds there
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    for n in prompt_lens:
        ids = torch.randint(0, min(hf_config.vocab_size, 32000), (1, n), generator=gen).cuda()
        times = []
        with torch.inference_mode():
            for _ in range(4):
                torch.cuda.synchronize()
                start = time.perf_counter()
                hf(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        rows.append(dict(prompt_len=n, engine_s=engine_s[n], transformers_s=sorted(times[1:])[1]))
        print(f"TTFT {n}: transformers forward {sorted(times[1:])[1]:.3f} s", flush=True)
    return rows


def load_before(path: str | None):
    if not path:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("before_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    p = parser(__doc__, "random:qwen3-8b")
    p.add_argument("--sweep", action="store_true", help="also time the candidate launch shapes")
    p.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--ttft", default="", help="comma-separated prompt lengths for the first-token runs")
    p.add_argument("--before", default=None, help="a file holding an earlier zipage_kernels/triton_attention.py to compare")
    args = parse_args(p, argv)
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = {s.strip() for s in args.shapes.split(",") if s.strip()}
    results = dict(device=device_description("cuda"), triton=triton.__version__,
                   attention=attention_rows(shapes, args.sweep, gen, load_before(args.before)))
    if args.ttft:
        results["ttft"] = ttft_rows(args.model, [int(x) for x in args.ttft.split(",")])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
