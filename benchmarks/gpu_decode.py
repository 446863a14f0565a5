"""Decode speed on the GPU: interactive streams, kernels per decode step, and a loaded decode step
against the bytes it must read.

    python3 benchmarks/gpu_decode.py --model random:qwen3-0.6b --json out.json
    python3 benchmarks/gpu_decode.py --model random:qwen3-8b --concurrency 1,4,16 --json out.json

Sections, one engine per --variants entry (random weights, bf16, CUDA graphs, default settings):
  interactive: N requests at once (--concurrency), --prompt-len random tokens, --output-len tokens
      each (EOS ignored, streamed): time to first token and decode tokens per second per request
      ((output - 1) / (last token - first token)), medians over the requests;
  step: kernels in one batch-1 decode step (torch.profiler, eager forward and engine step with the
      graph), the graph replay's GPU time, and the engine step's wall time (host included);
  loaded: --loaded-batch requests with --loaded-context-token prompts all decoding; the median
      engine step and graph replay against (weights + KV entries read) at the measured
      device-to-device copy bandwidth.
--temperature T (and --top-p P, --top-k K) makes the interactive requests sample, seeded, as a chat does.
--overlap on|off forces overlapped decode steps on or off (default: the engine's choice, on for CUDA).
--budget-policy fixed|elastic sets the engine's budget policy (with --compression 1); the interactive
rows count the compressions (pool_compressions: those run because the pool was short) and preemptions.
--variants picks the layer chains: fused (the Triton kernels the engine registers, as committed),
fused-no-pdl (the same, every kernel launched without programmatic dependent launch),
warm-l2-N (fused, each one-row step's product weights warmed in L2 by a side stream N products ahead),
unfolded (decode steps of 1-16 rows through skinny products, the norms and SiLU as their own
kernels), folded (the same with the norms and SiLU folded into the products), cublas (decode
products through cuBLAS, the norms and SiLU as their own kernels), reference (the PyTorch reference chains, several kernels each) or compile (the reference
chains through torch.compile); K/V stores go through Triton in all of them. A variant may be named
more than once, to interleave rounds against drift; its later rounds are kept as "fused#2", ...
--skinny-table loads the skinny products' block sizes from a benchmarks/gpu_skinny.py run instead of
the committed table; --decode-min-partition sets the shortest decode attention partition.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

import torch

import bench_common
from zipage.engine.config import KV_CACHE_DTYPES

FUSED_NAMES = ("rms_norm", "add_rms_norm", "silu_and_mul", "qk_norm_rope_store")
COMMITTED: dict = {}  # the skinny-path settings as committed, read on first use
COUNTS = ("compressions", "pool_compressions", "preemptions")  # engine totals an interactive row reports


def use_variant(variant: str) -> None:
    """Route the layer chains through one implementation (see the module docstring)."""
    from zipage import kernels
    from zipage.kernels import early_launch, reference, triton_cache, triton_linear, triton_ops

    if not COMMITTED:
        COMMITTED.update(rows=kernels.SKINNY_MAX_ROWS, fold=triton_linear.FOLD_MAX_ROWS, pdl=early_launch.ENABLED,
                         warm=triton_linear.WARM_AHEAD)
    triton_ops.register()
    kernels.SKINNY_MAX_ROWS, triton_linear.FOLD_MAX_ROWS = COMMITTED["rows"], COMMITTED["fold"]
    early_launch.ENABLED = COMMITTED["pdl"] and variant != "fused-no-pdl"
    triton_linear.WARM_AHEAD = COMMITTED["warm"]
    if variant.startswith("warm-l2-"):  # fused, each product's weights warmed in L2 N products ahead
        ahead = variant[len("warm-l2-"):]
        if not ahead.isdigit():
            raise SystemExit(f"variant {variant!r}: warm-l2-N takes a number of products (0: off)")
        triton_linear.WARM_AHEAD = int(ahead)
        return
    if variant in ("unfolded", "folded"):  # every decode step of 1-16 rows through skinny products
        kernels.SKINNY_MAX_ROWS = triton_linear.MAX_ROWS
        triton_linear.FOLD_MAX_ROWS = triton_linear.MAX_ROWS if variant == "folded" else 0
    if variant in ("fused", "fused-no-pdl", "unfolded", "folded"):
        return
    if variant not in ("cublas", "reference", "compile"):
        raise SystemExit(f"unknown variant {variant!r}")
    for name in kernels.SKINNY_NAMES:  # products through cuBLAS, chains as their own kernels
        kernels.TRITON_IMPLS.pop(name, None)
    if variant == "cublas":
        return
    compile_ = torch.compile if variant == "compile" else (lambda fn, **_: fn)

    def norm_rope(qkv, cos, sin, q_norm, k_norm, eps, kv_heads: int, head_dim: int):
        """The reference's arithmetic, without its stores."""
        tokens = qkv.shape[0]
        q_heads = qkv.shape[1] // head_dim - 2 * kv_heads
        qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
        v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
        if q_norm is not None:
            qk = torch.cat((reference.rms_norm(qk[:, :q_heads], q_norm, eps),
                            reference.rms_norm(qk[:, q_heads:], k_norm, eps)), dim=1)
        qk = reference._rotate(qk, cos.to(qkv.dtype)[:, None, :], sin.to(qkv.dtype)[:, None, :])
        return qk[:, :q_heads], qk[:, q_heads:], v

    chain = compile_(norm_rope, dynamic=True)

    def qk_norm_rope_store(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping,
                           query_cache, query_slot_mapping):
        q, k, v = chain(qkv, cos, sin, q_norm, k_norm, eps, k_cache.shape[2], k_cache.shape[3])
        triton_cache.store_kv(k, v, k_cache, v_cache, slot_mapping)  # graph safe, unlike the reference's
        if query_slot_mapping is not None:
            triton_cache.store_queries(q, query_cache, query_slot_mapping)
        return q

    kernels.TRITON_IMPLS.update(
        rms_norm=compile_(reference.rms_norm, dynamic=True),
        add_rms_norm=compile_(reference.add_rms_norm, dynamic=True),
        silu_and_mul=compile_(reference.silu_and_mul, dynamic=True),
        qk_norm_rope_store=qk_norm_rope_store)


def request_params(n: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None):
    """n tokens, greedy; or sampled at this temperature, top-p and top-k (seeded), as a chat samples them."""
    from zipage.engine.config import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed if temperature else None,
                          max_tokens=n, ignore_eos=True)


def prompts_of(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def interactive(engine, num: int, prompt_len: int, output_len: int, seed: int,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> dict:
    # A short run of the same shape first: Triton specialises kernels on sizes (a prefill of
    # num x prompt_len tokens compiles once), which is start-up cost, not time to first token.
    for p in prompts_of(num, prompt_len, min(engine.vocab_size, 32000), seed + 1000):
        engine.add_request(p, request_params(4))
    while engine.has_work():
        engine.step()
    seqs, start = [], time.perf_counter()
    for p in prompts_of(num, prompt_len, min(engine.vocab_size, 32000), seed):
        seqs.append(engine.add_request(p, request_params(output_len, temperature, top_p, top_k, seed + len(seqs)), stream=True))
    before = {k: engine.totals[k] for k in COUNTS}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        now = time.perf_counter()
        for s in seqs:
            if s.num_output_tokens >= 1 and s.id not in first:
                first[s.id] = now
            if s.is_finished and s.id not in last:
                last[s.id] = now
    total = time.perf_counter() - start
    ttft = [first[s.id] - start for s in seqs]
    rate = [(s.num_output_tokens - 1) / (last[s.id] - first[s.id]) for s in seqs]
    return {"requests": num, "prompt_len": prompt_len, "output_len": output_len,
            "ttft_ms_median": 1e3 * statistics.median(ttft), "ttft_ms_max": 1e3 * max(ttft),
            "decode_tok_per_s_per_request_median": statistics.median(rate),
            "decode_tok_per_s_per_request_min": min(rate),
            "aggregate_tok_per_s": sum(s.num_output_tokens for s in seqs) / total,
            "mean_step_ms": 1e3 * total / steps, **{k: engine.totals[k] - before[k] for k in COUNTS}}


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def replay_ms(graph, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_profile(engine, steps: int, path: str | None) -> None:
    """cProfile of `steps` engine steps (host side), the 30 largest self times, to `path`."""
    if not path:
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    with open(path, "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)


def timed_steps(engine, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def step_profile(engine, seed: int, profile_path: str | None = None) -> dict:
    """One request decoding: kernels per step (eager forward vs graph) and where a step's time goes."""
    seq = engine.add_request(prompts_of(1, 64, min(engine.vocab_size, 32000), seed)[0], request_params(400))
    while seq.num_output_tokens < 2:
        engine.step()
    runner = engine.runner
    graphs = runner.graphs
    result = {"graph_kernels_per_step": count_kernels(engine.step), "graph_step_kernels": bench_common.kernel_breakdown(engine.step)}
    runner.graphs = None
    result["eager_kernels_per_step"] = count_kernels(engine.step)
    result["eager_step_ms_median"] = statistics.median(timed_steps(engine, 30))
    runner.graphs = graphs
    result["engine_step_ms_median"] = statistics.median(timed_steps(engine, 100))
    host_profile(engine, 100, profile_path)
    if graphs is not None:
        result["graph_replay_ms_b1"] = replay_ms(graphs.graphs[1])
    engine.abort(seq.id)
    return result


def copy_bandwidth() -> float:
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3)  # read + write


def loaded_step(engine, batch: int, context: int, bandwidth: float, seed: int,
                profile_path: str | None = None) -> dict:
    seqs = [engine.add_request(p, request_params(256)) for p in prompts_of(batch, context, min(engine.vocab_size, 32000), seed)]
    while engine.scheduler.waiting or any(s.num_output_tokens < 2 for s in seqs):
        engine.step()
    runner = engine.runner
    step_ms = timed_steps(engine, 20)
    host_profile(engine, 10, profile_path)
    # an entry of one head: its values, and in fp8 its float32 scale
    per_entry = runner.head_dim * runner.kv_dtype.itemsize + (4 if runner.kv_quantized else 0)
    kv_entries = sum(s.kv_len for s in seqs)
    kv_bytes = kv_entries * runner.num_layers * 2 * runner.num_kv_heads * per_entry
    read = kv_bytes + runner.weight_bytes
    out = {"batch": batch, "context": context, "kv_bytes_read": kv_bytes, "weight_bytes": runner.weight_bytes,
           "bytes_read": read, "copy_bandwidth_GBps": bandwidth / 1e9, "roofline_ms": 1e3 * read / bandwidth,
           "engine_step_ms_median": statistics.median(step_ms)}
    if runner.graphs is not None:
        size = next(b for b in runner.graphs.buckets if b >= batch)
        out["graph_replay_ms"] = replay_ms(runner.graphs.graphs[size], 20)
        out["graph_over_roofline"] = out["graph_replay_ms"] / out["roofline_ms"]
    out["step_over_roofline"] = out["engine_step_ms_median"] / out["roofline_ms"]
    for s in seqs:
        engine.abort(s.id)
    return out


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "random:qwen3-0.6b")
    parser.add_argument("--variants", default="fused")
    parser.add_argument("--sections", default="interactive,step,loaded")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--loaded-batch", type=int, default=64)
    parser.add_argument("--loaded-context", type=int, default=2000)
    parser.add_argument("--compression", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--budget-policy", choices=("fixed", "elastic"), default="fixed",
                        help="fixed: compress at the budget; elastic: only when the pool is short")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="interactive requests sample at this temperature (seeded); 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="and with this top-p")
    parser.add_argument("--top-k", type=int, default=0, help="and this top-k (0: none)")
    parser.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                        help="plan each decode step while the previous one runs (auto: the engine's default)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the script")
    parser.add_argument("--profile-dir", default=None, help="write host-side profiles of the step sections here")
    parser.add_argument("--skinny-table", default=None, help="skinny_table.json of a gpu_skinny.py run")
    parser.add_argument("--decode-min-partition", type=int, default=None,
                        help="shortest decode attention partition in tokens, a multiple of the key tile "
                             "(default: the committed DECODE_MIN_PARTITION)")
    bench_common.add_decode_launch_flag(parser)
    args = bench_common.parse_args(parser, argv)
    launches = bench_common.set_decode_launches(args.decode_launch) if args.decode_launch else None
    if args.decode_min_partition is not None:
        from zipage.kernels import triton_attention

        if args.decode_min_partition <= 0 or args.decode_min_partition % triton_attention.DECODE_TILE:
            parser.error(f"--decode-min-partition must be a positive multiple of {triton_attention.DECODE_TILE}")
        triton_attention.DECODE_MIN_PARTITION = args.decode_min_partition
    if args.skinny_table:
        from gpu_skinny import load_table

        print(f"skinny table: {len(load_table(args.skinny_table))} shapes from {args.skinny_table}", flush=True)

    from zipage.engine.config import EngineConfig
    from zipage.engine.core.engine_core import EngineCore

    on_gpu = args.device != "cpu"
    results = {"model": args.model, **bench_common.device_description(args.device), "args": vars(args),
               "decode_launches": launches, "variants": {}}
    sections = args.sections.split(",")
    if not on_gpu:  # kernel counts and graph replays need CUDA
        sections = [x for x in sections if x != "step"]
    bandwidth = (copy_bandwidth() if on_gpu else 20e9) if "loaded" in sections else None
    log = lambda line: print(line, flush=True)  # noqa: E731

    def save():
        bench_common.write_json(args.json, results)

    for variant in args.variants.split(","):
        use_variant(variant)
        # a variant named again (rounds interleaved against drift) keeps every round: "fused#2", ...
        rounds = sum(1 for key in results["variants"] if key.split("#")[0] == variant)
        r = results["variants"][variant if rounds == 0 else f"{variant}#{rounds + 1}"] = {}
        start = time.perf_counter()
        try:
            engine = EngineCore(EngineConfig(model=args.model, device=args.device,
                                             compression=bool(args.compression), seed=args.seed,
                                             budget_policy=args.budget_policy, kv_cache_dtype=args.kv_cache_dtype,
                                             overlap_steps={"auto": None, "on": True, "off": False}[args.overlap]))
        except Exception as e:  # record and go on to the next variant
            r["error"] = f"{type(e).__name__}: {e}"
            log(f"  error: {r['error']}")
            continue
        r["startup_s"] = time.perf_counter() - start
        log(f"{args.model} {variant}: engine up in {r['startup_s']:.1f} s")
        try:
            warm = engine.add_request(prompts_of(1, args.prompt_len, min(engine.vocab_size, 32000), 99)[0], request_params(16))
            while not warm.is_finished:
                engine.step()
            if "interactive" in sections:
                r["interactive"] = []
                for n in [int(x) for x in args.concurrency.split(",")]:
                    row = interactive(engine, n, args.prompt_len, args.output_len, args.seed + n,
                                      args.temperature, args.top_p, args.top_k)
                    r["interactive"].append(row)
                    log(f"  interactive: {json.dumps(row)}")
                    save()
            if "step" in sections:
                r["step"] = step_profile(engine, args.seed, args.profile_dir and f"{args.profile_dir}/host_b1_{variant}.txt")
                log(f"  step: {json.dumps(r['step'])}")
                save()
            if "loaded" in sections:
                r["loaded"] = loaded_step(engine, args.loaded_batch, args.loaded_context, bandwidth, args.seed,
                                          args.profile_dir and f"{args.profile_dir}/host_loaded_{variant}.txt")
                log(f"  loaded: {json.dumps(r['loaded'])}")
                save()
        except Exception as e:  # record and go on to the next variant
            r["error"] = f"{type(e).__name__}: {e}"
            log(f"  error: {r['error']}")
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        save()
    return results


if __name__ == "__main__":
    main()
