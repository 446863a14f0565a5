"""GPU checks and timings of the Triton kernels (run on the H200).

    python3 benchmarks/gpu_check.py --out DIR            # real sizes, bf16, on CUDA (well under 8 minutes)
    python3 benchmarks/gpu_check.py --out DIR --smoke    # tiny sizes on the CPU with TRITON_INTERPRET=1

Sections (each in its own try/except: a failure is recorded and the script goes on):
  1. kernel checks: every Triton kernel against kernels.reference run on the same device in fp32
     (relative-norm error ||out - ref|| / ||ref|| < 1e-2 for bf16; exact for the copies and the keep set),
     plus fp32 checks of the attention kernels (IEEE dot path), the full compression pipeline of
     engine.compressor (Triton vs reference keep sets), a CUDA-graph capture of decode attention
     and the fused layer chains (add + RMSNorm, q/k norm + RoPE + stores, SiLU-and-multiply), the
     skinny decode products with their fused prologues at the 0.6B and 8B projection shapes (and a
     CUDA graph of split-K products, also launched early with programmatic dependent launch on Hopper,
     decode attention's graph, and the RoPE/store kernel then decode attention replayed on new tokens,
     against plain launches); an engine with early launches against
     the same engine without them (same tokens); the draw of next tokens (sample_rows) against the
     reference on bf16-rounded logits of Qwen3's vocabulary;
  2. engine parity: check_engine_parity() - greedy tokens of the CUDA engine (fp32, Triton kernels)
     against transformers on tiny random Llama/Qwen2/Qwen3 models;
  3. timings (triton.testing.do_bench, median): paged decode attention at batch 256 x 2048 tokens
     (bytes of K+V read per second against the device-to-device copy bandwidth), decode at batch 1 x
     32k (split-K), prefill, and one full compression of a full-budget request.
Prints a PASS/FAIL table and writes DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import bench_common  # noqa: E402
from zipage import kernels  # noqa: E402
from zipage.kernels import reference as ref  # noqa: E402
from zipage.kernels import triton_ops  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    triton_ops.patch_interpreter_for_numpy2()

BF16_TOL = 1e-2
FP32_TOL = 1e-4


@dataclass
class Sizes:
    device: str
    dtype: torch.dtype
    kv_heads: int
    q_heads: int
    head_dim: int
    block_size: int
    decode_batch: int
    decode_ctx: int
    long_ctx: int
    prefill_q: tuple  # (min, max) new tokens per sequence
    prefill_prefix: tuple  # (min, max) cached prefix
    prefill_seqs: int
    budget_blocks: int  # n; a full-budget request holds n + 1 blocks
    window: int
    layers: int
    keep_rows: tuple  # row lengths of the keep_indices checks
    gqa_sweep: tuple  # (group, head_dim) of the decode/prefill sweep
    sweep_batch: int
    sweep_ctx: int
    parity_new_tokens: int


FULL = Sizes(device="cuda", dtype=torch.bfloat16, kv_heads=8, q_heads=32, head_dim=128, block_size=256,
             decode_batch=256, decode_ctx=2048, long_ctx=32768, prefill_q=(512, 2048), prefill_prefix=(0, 1024),
             prefill_seqs=8, budget_blocks=8, window=16, layers=36, keep_rows=(2304, 8192, 32768),
             gqa_sweep=((1, 128), (2, 64), (4, 128), (8, 128), (4, 64)), sweep_batch=16, sweep_ctx=1500,
             parity_new_tokens=40)
SMOKE = Sizes(device="cpu", dtype=torch.float32, kv_heads=2, q_heads=8, head_dim=64, block_size=16,
              decode_batch=3, decode_ctx=96, long_ctx=320, prefill_q=(16, 48), prefill_prefix=(0, 40),
              prefill_seqs=3, budget_blocks=4, window=8, layers=2, keep_rows=(80, 300),
              gqa_sweep=((2, 64),), sweep_batch=2, sweep_ctx=60, parity_new_tokens=6)

NAMES = triton_ops.NAMES


# ---------------------------------------------------------------------------------------------
# Helpers


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    denom = expected.norm().item()
    diff = (out - expected).norm().item()
    return diff / denom if denom > 0 else diff


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device) -> float:
    """Median milliseconds (do_bench on CUDA; one timed call after one warm-up elsewhere)."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@contextlib.contextmanager
def kernel_path(which: str, device):
    """Route every `kernels.<name>` call through one implementation.

    which="triton" on CUDA: the real dispatch seam (the implementations triton_ops registered);
    on the CPU (smoke) the module attributes are pointed at the Triton functions, which the
    interpreter runs. which="reference": the PyTorch reference everywhere."""
    saved_attrs = {name: getattr(kernels, name) for name in NAMES}
    saved_impls = dict(kernels.TRITON_IMPLS)
    try:
        if which == "reference":
            kernels.TRITON_IMPLS.clear()
        elif torch.device(device).type == "cuda":
            missing = [n for n in NAMES if n not in kernels.TRITON_IMPLS]
            if missing:
                raise RuntimeError(f"Triton implementations not registered: {missing}")
        else:
            for name in NAMES:
                setattr(kernels, name, triton_ops.IMPLS[name])
        yield
    finally:
        for name, fn in saved_attrs.items():
            setattr(kernels, name, fn)
        kernels.TRITON_IMPLS.clear()
        kernels.TRITON_IMPLS.update(saved_impls)


def randn(shape, gen, device, dtype=torch.float32):
    """Random normal tensor made on the device (fast for GiB-sized caches), seeded from the CPU generator."""
    device_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 1 << 62, (1,), generator=gen)))
    return torch.randn(shape, generator=device_gen, device=device, dtype=torch.float32).to(dtype)


def make_paged(lens, block_size, kv_heads, head_dim, dtype, device, gen, extra_cols=1, spare=4):
    """Shuffled paged caches holding sequences of these lengths, made on the device; tables -1 padded."""
    from zipage.testing import random_paged_cache

    k_cache, v_cache, tables = random_paged_cache(lens, block_size, kv_heads, head_dim, gen, spare_blocks=spare,
                                                  extra_cols=extra_cols, randn=lambda shape: randn(shape, gen, device, dtype))
    return k_cache, v_cache, tables.to(device)


class Report:
    def __init__(self):
        self.checks: list[dict] = []
        self.timings: list[dict] = []
        self.sections: dict[str, dict] = {}

    def check(self, name: str, metric: float, threshold: float, detail: str = "", exact: bool = False):
        passed = (metric == 0) if exact else (math.isfinite(metric) and metric < threshold)
        self.checks.append(dict(name=name, metric=metric, threshold=0.0 if exact else threshold,
                                passed=bool(passed), detail=detail))
        print(f"  {'PASS' if passed else 'FAIL'}  {name:44s} {metric:.3e}  {detail}", flush=True)

    def fail(self, name: str, exc: BaseException):
        tb = traceback.format_exc(limit=6)
        self.checks.append(dict(name=name, metric=float("nan"), threshold=None, passed=False,
                                detail=f"{type(exc).__name__}: {exc}", traceback=tb))
        print(f"  FAIL  {name:44s} raised {type(exc).__name__}: {exc}", flush=True)

    def attempt(self, name: str, fn, *args, **kwargs):
        """Run one case; an exception is recorded as a failure of `name` and the caller goes on."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the script must go on
            self.fail(name, exc)
            return None

    def time(self, name: str, ms: float, **extra):
        row = dict(name=name, ms=ms, **extra)
        self.timings.append(row)
        more = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"  {name:44s} {ms:9.3f} ms  {more}", flush=True)


def guarded(report: Report, name: str):
    """Decorator: run a check function, recording any exception as a failure of `name`."""
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the script must go on
                report.fail(name, exc)
            finally:
                report.sections[name] = dict(seconds=round(time.perf_counter() - start, 2))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return run
    return wrap


# ---------------------------------------------------------------------------------------------
# 1. Kernel checks


def check_cache_ops(report: Report, s: Sizes, gen):
    from zipage.kernels import triton_cache

    dev, dt = s.device, s.dtype
    k_cache, v_cache, _ = make_paged([s.block_size * 8], s.block_size, s.kv_heads, s.head_dim, dt, dev, gen)
    tokens = 3 * s.block_size // 2
    slots = torch.randperm(k_cache.shape[0] * s.block_size, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.to(dev)
    qkv = torch.randn(tokens, (s.q_heads + 2 * s.kv_heads) * s.head_dim, generator=gen).to(dev, dt)
    kv = s.kv_heads * s.head_dim
    key = qkv[:, s.q_heads * s.head_dim:s.q_heads * s.head_dim + kv].view(tokens, s.kv_heads, s.head_dim)
    value = qkv[:, -kv:].view(tokens, s.kv_heads, s.head_dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, k_ref, v_ref, slots)
    triton_cache.store_kv(key, value, k_cache, v_cache, slots)
    diff = max((k_cache.float() - k_ref.float()).abs().max().item(), (v_cache.float() - v_ref.float()).abs().max().item())
    report.check("store_kv", diff, 0, f"{tokens} tokens, strided K/V views", exact=True)

    rows = 4 * s.window
    qcache = torch.randn(2, rows, s.q_heads, s.head_dim, generator=gen).to(dev, dt)[1]
    query = torch.randn(tokens, s.q_heads, s.head_dim, generator=gen).to(dev, dt)
    qslots = torch.full((tokens,), -1, dtype=torch.int64)
    filled = min(rows, tokens)
    qslots[:filled] = torch.randperm(rows, generator=gen)[:filled]
    qslots = qslots[torch.randperm(tokens, generator=gen)].to(dev)
    expected = qcache.clone()
    ref.store_queries(query, expected, qslots)
    triton_cache.store_queries(query, qcache, qslots)
    report.check("store_queries", (qcache.float() - expected.float()).abs().max().item(), 0, exact=True)

    # Compaction of a full-budget request into blocks it already holds (sources overlap targets).
    n = s.budget_blocks
    kv_len, keep = (n + 1) * s.block_size, n * s.block_size
    k_cache, v_cache, tables = make_paged([kv_len], s.block_size, s.kv_heads, s.head_dim, dt, dev, gen, extra_cols=0)
    table = tables[0].long()
    score_cache = torch.randn(k_cache.shape[0] * s.block_size, s.kv_heads, generator=gen).to(dev)
    token_slots = (table[:, None] * s.block_size + torch.arange(s.block_size, device=dev)[None, :]).flatten()
    keep_idx = ref.keep_indices(torch.randn(s.kv_heads, kv_len, generator=gen).to(dev), keep)
    src = token_slots[keep_idx]
    dst = token_slots[:keep].clone()
    kept_scores = torch.randn(s.kv_heads, keep, generator=gen).to(dev)
    expected = [k_cache.clone(), v_cache.clone(), score_cache.clone()]
    ref.compact_kv(*expected, src, dst, kept_scores)
    triton_cache.compact_kv(k_cache, v_cache, score_cache, src, dst, kept_scores)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip((k_cache, v_cache, score_cache), expected))
    report.check("compact_kv (overlapping)", diff, 0, f"{kv_len} -> {keep} tokens x {s.kv_heads} heads", exact=True)


def bulk_copy_launch(cache_dtype):
    """A cache kind's decode launch with whole tiles by bulk copy and table entries read ahead, at
    three stages (launch options off in the engine; docs/design-notes.md, "KV in 8 bits")."""
    from zipage.kernels import triton_attention

    return dataclasses.replace(triton_attention.decode_launch(cache_dtype), whole_tiles=True, tma=True,
                               table_ahead=16, stages=3)


def _decode_case(report, name, s, lens, group, head_dim, dtype, gen, tol, ways=None, min_partition=None,
                 extra_cols=1, launch=None):
    from zipage.kernels import triton_attention

    dev = s.device
    kv_heads = s.kv_heads
    k_cache, v_cache, tables = make_paged(lens, s.block_size, kv_heads, head_dim, dtype, dev, gen, extra_cols=extra_cols)
    query = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dev, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    scale = head_dim ** -0.5
    out = triton_attention.paged_decode_attention_impl(query, k_cache, v_cache, tables, context_lens, scale,
                                                       num_partitions=ways, min_partition=min_partition, launch=launch)
    expected = ref.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables, context_lens, scale)
    width = tables.shape[1]
    splits = ways or triton_attention.decode_num_partitions(len(lens), kv_heads, width, s.block_size, query.device)
    report.check(name, rel_err(out, expected), tol,
                 f"B={len(lens)} Hq={kv_heads * group} Hkv={kv_heads} D={head_dim} max_ctx={max(lens)} splits={splits}")


def check_decode(report: Report, s: Sizes, gen):
    g = s.q_heads // s.kv_heads
    tol = BF16_TOL if s.dtype != torch.float32 else FP32_TOL
    lens = torch.randint(1, s.decode_ctx + 1, (s.decode_batch,), generator=gen)
    lens[::4] = s.decode_ctx
    ragged = [1, 2, s.block_size - 1, s.block_size, s.block_size + 1, s.long_ctx // 4 + 3, s.long_ctx // 8]
    cases = [
        (f"decode B{s.decode_batch} ctx<={s.decode_ctx}", lens.tolist(), g, s.head_dim, s.dtype, tol, {}),
        (f"decode B1 ctx{s.long_ctx} (split-K)", [s.long_ctx], g, s.head_dim, s.dtype, tol, {}),
        ("decode ragged, -1 padded (split-K)", ragged, g, s.head_dim, s.dtype, tol, dict(extra_cols=3)),
        ("decode forced 6-way split, 64-token partitions", ragged[:4], g, s.head_dim, s.dtype, tol,
         dict(ways=6, min_partition=64)),
        ("decode fp32 (IEEE dot)", ragged, g, s.head_dim, torch.float32, FP32_TOL, {}),
        (f"decode B{s.decode_batch}, bulk copies", lens.tolist(), g, s.head_dim, s.dtype, tol,
         dict(launch=bulk_copy_launch(s.dtype))),
        ("decode ragged (split-K), bulk copies", ragged, g, s.head_dim, s.dtype, tol,
         dict(extra_cols=3, launch=bulk_copy_launch(s.dtype))),
    ]
    for group, head_dim in s.gqa_sweep:
        sweep = torch.randint(1, s.sweep_ctx + 1, (s.sweep_batch,), generator=gen).tolist()
        cases.append((f"decode GQA {group} D{head_dim}", sweep, group, head_dim, s.dtype, tol, {}))
    for name, case_lens, group, head_dim, dtype, case_tol, kw in cases:
        report.attempt(name, _decode_case, report, name, s, case_lens, group, head_dim, dtype, gen, case_tol, **kw)


def _prefill_case(report, name, s, q_lens, prefixes, group, head_dim, dtype, gen, tol):
    from zipage.kernels import triton_attention

    dev = s.device
    lens = [q + p for q, p in zip(q_lens, prefixes)]
    k_cache, v_cache, tables = make_paged(lens, s.block_size, s.kv_heads, head_dim, dtype, dev, gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    query = torch.randn(sum(q_lens), s.kv_heads * group, head_dim, generator=gen).to(dev, dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    scale = head_dim ** -0.5
    out = triton_attention.prefill_attention(query, k_cache, v_cache, tables, cu, context_lens, scale)
    expected = ref.prefill_attention(query.float(), k_cache.float(), v_cache.float(), tables, cu, context_lens, scale)
    report.check(name, rel_err(out, expected), tol,
                 f"{len(q_lens)} seqs, {sum(q_lens)} new tokens, prefixes {min(prefixes)}..{max(prefixes)}")


def check_prefill(report: Report, s: Sizes, gen):
    g = s.q_heads // s.kv_heads
    tol = BF16_TOL if s.dtype != torch.float32 else FP32_TOL
    q_lens = torch.randint(s.prefill_q[0], s.prefill_q[1] + 1, (s.prefill_seqs,), generator=gen).tolist()
    prefixes = torch.randint(s.prefill_prefix[0], s.prefill_prefix[1] + 1, (s.prefill_seqs,), generator=gen).tolist()
    prefixes[0] = 0
    cases = [
        (f"prefill {s.prefill_seqs} seqs, cached prefixes", q_lens, prefixes, g, s.head_dim, s.dtype, tol),
        ("prefill fp32 (IEEE dot)", [q // 4 + 1 for q in q_lens[:3]], prefixes[:3], g, s.head_dim, torch.float32,
         FP32_TOL),
    ]
    for group, head_dim in s.gqa_sweep:
        cases.append((f"prefill GQA {group} D{head_dim}", [s.sweep_ctx // 2, 1, 37], [0, s.sweep_ctx, 5],
                      group, head_dim, s.dtype, tol))
    for name, ql, pf, group, head_dim, dtype, case_tol in cases:
        report.attempt(name, _prefill_case, report, name, s, ql, pf, group, head_dim, dtype, gen, case_tol)


def _reference_sums(keys, block, threshold):
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    if block is None:
        return ref._redundancy_sums(unit, threshold)
    heads, tokens, dim = unit.shape
    padded = torch.nn.functional.pad(unit, (0, 0, 0, -tokens % block))
    return ref._redundancy_sums(padded.reshape(-1, block, dim), threshold).reshape(heads, -1)[:, :tokens]


def check_scores(report: Report, s: Sizes, gen):
    from zipage.kernels import triton_scores

    dev, dt = s.device, s.dtype
    tol = BF16_TOL if dt != torch.float32 else FP32_TOL
    kv_len = (s.budget_blocks + 1) * s.block_size
    k_cache, _, tables = make_paged([kv_len], s.block_size, s.kv_heads, s.head_dim, dt, dev, gen, extra_cols=0)
    table = tables[0].long()
    queries = torch.randn(s.window, s.q_heads, s.head_dim, generator=gen).to(dev, dt)
    scale = s.head_dim ** -0.5
    expected = ref.window_attention_score(queries.float(), k_cache.float(), table, kv_len, scale)

    def window():
        out = triton_scores.window_attention_score(queries, k_cache, table, kv_len, scale)
        report.check("window_attention_score", rel_err(out, expected), tol, f"w={s.window} kv_len={kv_len}")

    def pool_and_merge():
        pooled = triton_scores.pool_scores(expected, 5)
        report.check("pool_scores", (pooled - ref.pool_scores(expected, 5)).abs().max().item(), 0, exact=True)
        previous = torch.rand(kv_len, s.kv_heads, generator=gen).to(dev).t()
        merged = triton_scores.global_score_merge(expected, previous, kv_len - s.block_size, 0.8)
        diff = (merged - ref.global_score_merge(expected, previous, kv_len - s.block_size, 0.8)).abs().max().item()
        report.check("global_score_merge", diff, 0, exact=True)

    keys = ref.gather_kv(k_cache, table, kv_len).transpose(0, 1)  # [Hkv, T, D] strided, as the compressor
    keys[:, 10:20] = keys[:, :10] + 0.3 * keys[:, 30:40]  # some near-duplicates

    def redundancy(block, label):
        # The softmax over T of sums / (T * temperature) is close to uniform, so the row sums are the
        # sensitive quantity: check both.
        sums = triton_scores.redundancy_sums(keys, block, 0.5)
        report.check(f"redundancy sums {label}", rel_err(sums, _reference_sums(keys, block, 0.5)), tol,
                     f"T={kv_len} range {sums.min().item():.3g}..{sums.max().item():.3g}")
        got = triton_scores.redundancy_score(keys, block, 0.5, 0.4)
        report.check(f"redundancy_score {label}", rel_err(got, ref.redundancy_score(keys.float(), block, 0.5, 0.4)), tol)

    def keep(tokens):
        count = min(s.budget_blocks * s.block_size, tokens - 1)
        scores = torch.randn(s.kv_heads, tokens, generator=gen).to(dev)
        scores[:, -s.window:] = float("inf")
        got = triton_scores.keep_indices(scores, count)
        mismatch = (got != ref.keep_indices(scores, count)).sum().item()
        report.check(f"keep_indices T={tokens} keep={count}", float(mismatch), 0, "mismatched indices", exact=True)

    report.attempt("window_attention_score", window)
    report.attempt("pool_scores / global_score_merge", pool_and_merge)
    report.attempt("redundancy raw", redundancy, None, "raw")
    report.attempt("redundancy lightning", redundancy, s.block_size, "lightning")
    for tokens in s.keep_rows:
        report.attempt(f"keep_indices T={tokens}", keep, tokens)


class _FakeRunner(SimpleNamespace):
    """What the compressor reads of a ModelRunner: its caches, and each layer's view of them."""

    def layer_cache(self, layer: int) -> dict:
        from zipage.engine.execution.model_runner import ModelRunner

        return ModelRunner.layer_cache(self, layer)


def _fake_runner(s: Sizes, gen, num_blocks: int):
    dev = torch.device(s.device)
    kv = randn((s.layers, 2, num_blocks, s.block_size, s.kv_heads, s.head_dim), gen, dev, s.dtype)
    return _FakeRunner(
        device=dev, dtype=s.dtype, num_layers=s.layers, head_dim=s.head_dim, kv_cache=kv, kv_scales=None,
        query_cache=torch.randn(s.layers, 2 * s.window, s.q_heads, s.head_dim, generator=gen).to(dev, s.dtype),
        score_cache=torch.rand(s.layers, num_blocks * s.block_size, s.kv_heads, generator=gen).to(dev),
        position_cache=torch.randint(0, 1 << 20, (s.layers, num_blocks * s.block_size, s.kv_heads), generator=gen,
                                     dtype=torch.int32).to(dev),
        choice_cache=torch.zeros(s.layers, num_blocks * s.block_size, s.kv_heads, device=dev))


def _compression_job(s: Sizes, gen, num_blocks: int, first: bool):
    from zipage.engine.kv.compressor import CompressionJob

    n = s.budget_blocks
    table = torch.randperm(num_blocks, generator=gen)[:n + 1].tolist()
    extra = {}
    if "ready" in {f.name for f in dataclasses.fields(CompressionJob)} and torch.device(s.device).type == "cuda":
        extra["ready"] = torch.cuda.Event()  # the compression stream waits for the KV writes (all done here)
        extra["ready"].record()
    return CompressionJob(seq=SimpleNamespace(query_slot=1), kv_len=(n + 1) * s.block_size, source_table=table,
                          targets=table[:n], decode_block=table[n], release=[], first=first,
                          num_scored=0 if first else n * s.block_size, **extra)


def _compressor(s: Sizes, runner):
    from zipage.engine.kv.compressor import Compressor
    from zipage.engine.config import EngineConfig

    config = EngineConfig(model="random:qwen3-tiny", compression=True, block_size=s.block_size,
                          max_cache_blocks_per_seq=s.budget_blocks, window=s.window)
    return Compressor(config, runner, blocks=None, block_size=s.block_size)


def check_compression_pipeline(report: Report, s: Sizes, gen):
    """engine.compressor end to end on a full-budget request: Triton vs reference keep sets per layer
    and head (they may differ only where bf16 scores tie), and the compacted caches."""
    num_blocks = s.budget_blocks + 4
    base = _fake_runner(s, gen, num_blocks)
    for first in (True, False):
        job_gen_seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
        results = {}
        for which in ("triton", "reference"):
            runner = _FakeRunner(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                        for k, v in vars(base).items()})
            compressor = _compressor(s, runner)
            job = _compression_job(s, torch.Generator().manual_seed(job_gen_seed), num_blocks, first)
            keeps = []
            with kernel_path(which, s.device):
                original = kernels.keep_indices

                def recording(scores, keep, _orig=original):
                    out = _orig(scores, keep)
                    keeps.append(out.clone())
                    return out

                kernels.keep_indices = recording
                try:
                    compressor.execute(job)
                finally:
                    kernels.keep_indices = original
            sync(s.device)
            results[which] = (keeps, runner, job)
        keeps_t, runner_t, job = results["triton"]
        keeps_r, runner_r, _ = results["reference"]
        overlap = []
        for a, b in zip(keeps_t, keeps_r):
            for row_a, row_b in zip(a, b):
                overlap.append(len(set(row_a.tolist()) & set(row_b.tolist())) / row_a.numel())
        mean_overlap = sum(overlap) / max(1, len(overlap))
        # Target blocks hold the same entries wherever the keep sets agree exactly.
        targets = torch.tensor(job.targets, device=runner_t.kv_cache.device)
        same_rows = 0
        total_rows = 0
        for layer in range(s.layers):
            for h in range(s.kv_heads):
                if torch.equal(keeps_t[layer][h], keeps_r[layer][h]):
                    total_rows += 1
                    same_rows += int(torch.equal(runner_t.kv_cache[layer, :, targets, :, h],
                                                 runner_r.kv_cache[layer, :, targets, :, h]))
        label = "first (pooling)" if first else "later (global score)"
        report.check(f"compression pipeline {label}: keep-set gap", 1.0 - mean_overlap, 0.02,
                     f"{len(keeps_t)} layers, mean overlap {mean_overlap:.4f}, "
                     f"identical sets -> identical blocks {same_rows}/{total_rows}")
        if same_rows != total_rows:
            report.checks[-1]["passed"] = False


def check_fused(report: Report, s: Sizes, gen):
    """The decoder layer's fused chains (residual add + RMSNorm, q/k norm + RoPE + stores, SiLU and
    multiply) against the reference run in fp32 on the same inputs, in the serving dtype and fp32."""
    from zipage.kernels import triton_fused

    dev = s.device
    tokens, hidden, inter = 2 * s.block_size + 3, s.q_heads * s.head_dim, 3 * s.q_heads * s.head_dim
    for dt, tol in ((s.dtype, BF16_TOL), (torch.float32, FP32_TOL)):
        label = str(dt).replace("torch.", "")
        x, res = randn((tokens, hidden), gen, dev, dt), randn((tokens, hidden), gen, dev, dt)
        w = (randn((hidden,), gen, dev) * 0.1 + 1).to(dt)
        normed, summed = triton_fused.add_rms_norm(x, res, w, 1e-6)
        ref_normed, ref_summed = ref.add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
        report.check(f"add_rms_norm {label} (sum)", rel_err(summed, ref_summed), tol)
        report.check(f"add_rms_norm {label} (norm)", rel_err(normed, ref_normed), tol)
        report.check(f"rms_norm {label}", rel_err(triton_fused.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6)), tol)
        gu = randn((tokens, 2 * inter), gen, dev, dt) * 3
        report.check(f"silu_and_mul {label}", rel_err(triton_fused.silu_and_mul(gu), ref.silu_and_mul(gu.float())), tol)
        for norm in (True, False):
            width = (s.q_heads + 2 * s.kv_heads) * s.head_dim
            qkv = randn((tokens, width), gen, dev, dt)
            length = 4 * s.long_ctx
            positions = torch.randint(0, length, (tokens,), generator=gen).to(dev)
            inv = 1.0 / (1e6 ** (torch.arange(0, s.head_dim, 2, device=dev).float() / s.head_dim))
            emb = torch.arange(length, device=dev).float()[:, None] * inv[None, :]
            rows = torch.stack((torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()), 1)[positions]
            cos, sin = rows[:, 0], rows[:, 1]
            qn = (randn((s.head_dim,), gen, dev) * 0.1 + 1).to(dt) if norm else None
            kn = (randn((s.head_dim,), gen, dev) * 0.1 + 1).to(dt) if norm else None
            k_cache, v_cache, _ = make_paged([tokens + s.block_size], s.block_size, s.kv_heads, s.head_dim, dt, dev, gen)
            slots = torch.randperm(k_cache.shape[0] * s.block_size, generator=gen)[:tokens]
            slots[::5] = -1
            slots = slots.to(dev)
            qcache = randn((tokens, s.q_heads, s.head_dim), gen, dev, dt)
            qslots = torch.randperm(tokens, generator=gen).to(dev)
            qslots[::3] = -1
            kc, vc, qc = k_cache.float().clone(), v_cache.float().clone(), qcache.float().clone()
            q_ref = ref.qk_norm_rope_store(qkv.float(), cos, sin, qn.float() if norm else None,
                                           kn.float() if norm else None, 1e-6, kc, vc, slots, qc, qslots)
            q = triton_fused.qk_norm_rope_store(qkv, cos, sin, qn, kn, 1e-6, k_cache, v_cache, slots,
                                                qcache, qslots)
            tag = f"qk_norm_rope_store {label}{' norm' if norm else ''}"
            report.check(f"{tag} (q)", rel_err(q, q_ref), tol)
            report.check(f"{tag} (k cache)", rel_err(k_cache, kc), tol)
            report.check(f"{tag} (v cache)", rel_err(v_cache, vc), tol)
            report.check(f"{tag} (query rows)", rel_err(qcache, qc), tol)


SAMPLING_SETTINGS = (dict(temperature=0.7), dict(temperature=0.6, top_p=0.95), dict(temperature=0.6, top_k=20),
                     dict(temperature=0.6, top_k=20, top_p=0.95), dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05))


def check_sampling(report: Report, s: Sizes, gen):
    """The draw of next tokens (kernels.sample_rows) against the reference on the same rows: logits
    rounded to bf16 (ties, as a bf16 head gives them) over Qwen3's vocabulary, each setting alone and
    all mixed in one batch, with the candidates the CUDA sampler ranks. The share of rows whose token
    differs (only a draw within rounding of a boundary may)."""
    from zipage.engine import SamplingParams
    from zipage.engine.execution.sampler import rank, sampling_table
    from zipage.kernels.sampling import triton_sampling

    vocab = 151936 if s.device == "cuda" else 5000
    batches = [[SamplingParams(**kw)] * rows for kw in SAMPLING_SETTINGS for rows in (1, 64)]
    batches.append([SamplingParams(**SAMPLING_SETTINGS[i % len(SAMPLING_SETTINGS)]) for i in range(40)])
    differ = total = 0
    for params in batches:
        logits = (torch.randn(len(params), vocab, generator=gen) * 3).bfloat16().float().to(s.device)
        uniforms = torch.rand(len(params), dtype=torch.float64, generator=gen).tolist()
        ranked, asks = rank(logits, params, may_sync=False)
        table = sampling_table(params, uniforms, logits)
        got = triton_sampling.sample_rows(logits, table, ranked, asks)
        want = ref.sample_rows(logits, table, ranked, asks)
        differ += int((got != want).sum())
        total += len(params)
    report.check("sample_rows: rows drawing another token", differ / total, 0.01, f"{differ} of {total} rows")


# (N, K) of the Qwen3-0.6B and -8B projections: QKV, O, gate/up, down.
SKINNY_SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                 (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
SKINNY_SMOKE_SHAPES = ((96, 64), (40, 200))


def check_skinny(report: Report, s: Sizes, gen):
    """The skinny decode products (1, 3 and 16 rows) and their fused prologues against the
    reference compositions in fp32: every shape with its table config in the serving dtype; the
    first two also with a forced split-K and the broadcast-and-sum inner product, with a bias, in
    the serving dtype and fp32. Then a CUDA graph of split-K products replayed on new inputs
    equals eager, bit for bit (the arrival counters reset themselves)."""
    from zipage.kernels import early_launch
    from zipage.kernels import triton_linear as tlin

    dev = s.device
    shapes = SKINNY_SHAPES if torch.device(dev).type == "cuda" else SKINNY_SMOKE_SHAPES
    forced = (tlin.Config(32, 256, split_k=4), tlin.Config(16, 512, dot=False))
    for index, (n, k) in enumerate(shapes):
        cases = [(s.dtype, BF16_TOL, None)]
        if index < 2:
            cases += [(dt, tol, cfg) for dt, tol in ((s.dtype, BF16_TOL), (torch.float32, FP32_TOL)) for cfg in forced]
        for dt, tol, cfg in cases:
            label = str(dt).replace("torch.", "")
            w = (randn((n, k), gen, dev) / k ** 0.5).to(dt)
            b = randn((n,), gen, dev, dt) if cfg is not None else None
            nw = (randn((k,), gen, dev) * 0.1 + 1).to(dt)
            for rows in (1, 3, 16):
                if cfg is not None and not cfg.dot and rows > 1:
                    continue
                x, res = randn((rows, k), gen, dev, dt), randn((rows, k), gen, dev, dt)
                gu = randn((rows, 2 * k), gen, dev, dt) * 3
                tag = f"skinny {n}x{k} M{rows} {label} {'table' if cfg is None else ('split4' if cfg.dot else 'sum')}"
                out = tlin.skinny_matmul(x, w, b, config=cfg)[0]
                err = rel_err(out, ref.linear(x.float(), w.float(), b.float() if b is not None else None))
                normed, summed = tlin.skinny_matmul(x, w, None, tlin.ADD_NORM, res, nw, 1e-6, config=cfg)
                exp_n, exp_s = ref.norm_linear(x.float(), res.float(), nw.float(), 1e-6, w.float(), None)
                err = max(err, rel_err(normed, exp_n), rel_err(summed, exp_s))
                plain_norm = tlin.skinny_matmul(x, w, None, tlin.NORM, None, nw, 1e-6, config=cfg)[0]
                err = max(err, rel_err(plain_norm, ref.norm_linear(x.float(), None, nw.float(), 1e-6, w.float(), None)[0]))
                silu = tlin.skinny_matmul(gu, w, None, tlin.SILU_MUL, config=cfg)[0]
                err = max(err, rel_err(silu, ref.silu_mul_linear(gu.float(), w.float(), None)))
                report.check(tag, err, tol, "max of linear, add+norm (out, sum), norm, silu")
    if torch.device(dev).type != "cuda":
        return
    n, k = shapes[3]  # a split-K shape
    w, nw = (randn((n, k), gen, dev) / k ** 0.5).to(s.dtype), (randn((k,), gen, dev) * 0.1 + 1).to(s.dtype)
    w2 = (randn((k, n), gen, dev) / n ** 0.5).to(s.dtype)
    x, res = randn((16, k), gen, dev, s.dtype), randn((16, k), gen, dev, s.dtype)
    cfg = forced[0]

    def call():
        y, summed = tlin.skinny_matmul(x, w, None, tlin.ADD_NORM, res, nw, 1e-6, config=cfg)
        return tlin.skinny_matmul(torch.cat((y, y), 1), w2, None, tlin.SILU_MUL, config=cfg)[0], summed

    graph, static = bench_common.graph_of(call)
    worst = 0.0
    for _ in range(3):
        x.copy_(randn((16, k), gen, dev, s.dtype))
        res.copy_(randn((16, k), gen, dev, s.dtype))
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        worst = max(worst, *((a.float() - e.float()).abs().max().item() for a, e in zip(static, eager)))
    report.check("skinny split-K in CUDA graph (replay == eager)", worst, 0, exact=True)
    if not early_launch.available(torch.device(dev)):
        return

    # Programmatic dependent launch: the chain with every product started early (waiting for its x
    # inside the kernel), with and without the weight prefetch, gives the plain launches' bits,
    # eagerly and replayed from a graph.
    def chain(pdl):
        y, summed = tlin.skinny_matmul(x, w, None, tlin.ADD_NORM, res, nw, 1e-6, config=cfg, pdl=pdl)
        return tlin.skinny_matmul(torch.cat((y, y), 1), w2, None, tlin.SILU_MUL, config=cfg, pdl=pdl)[0], summed

    for lines in (0, tlin.PDL_PREFETCH_LINES):
        graph, static = bench_common.graph_of(lambda: chain(lines))
        worst = 0.0
        for _ in range(3):
            x.copy_(randn((16, k), gen, dev, s.dtype))
            res.copy_(randn((16, k), gen, dev, s.dtype))
            graph.replay()
            eager = chain(lines)
            plain = chain(-1)
            torch.cuda.synchronize()
            worst = max(worst, *((a.float() - p.float()).abs().max().item()
                                 for a, e, p in zip(static, eager, plain) for a in (a, e)))
        report.check(f"skinny with PDL, {lines} prefetched lines (graph and eager == plain launch)", worst, 0, exact=True)


def early_launch_off():
    """Every kernel launched the plain way (no programmatic dependent launch) inside the block."""
    from zipage.kernels import early_launch

    return mock.patch.object(early_launch, "ENABLED", False)


def check_cuda_graph(report: Report, s: Sizes, gen):
    """Decode attention captured in a CUDA graph, replayed on new inputs, equals eager (the engine's
    launch, and whole tiles by bulk copy, whose descriptors the graph keeps)."""
    from zipage.kernels import triton_attention

    if torch.device(s.device).type != "cuda":
        report.checks.append(dict(name="decode in CUDA graph", metric=0.0, threshold=0.0, passed=True,
                                  detail="skipped (no CUDA)"))
        return
    wide = s.long_ctx // s.block_size  # tables as wide as the engine's graphs (max_model_len / block)
    for launch, label in ((None, ""), (bulk_copy_launch(s.dtype), ", bulk copies")):
        for batch in (4, s.decode_batch):  # split-K path and single-pass path
            lens = [s.decode_ctx] * batch
            k_cache, v_cache, tables = make_paged(lens, s.block_size, s.kv_heads, s.head_dim, s.dtype, s.device, gen,
                                                  extra_cols=max(0, wide - s.decode_ctx // s.block_size))
            query = torch.randn(batch, s.q_heads, s.head_dim, generator=gen).to(s.device, s.dtype)
            context_lens = torch.tensor(lens, dtype=torch.int32, device=s.device)
            scale = s.head_dim ** -0.5

            def call():
                return triton_attention.paged_decode_attention_impl(query, k_cache, v_cache, tables, context_lens,
                                                                    scale, launch=launch)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = call()
            # New contents in the same tensors: other lengths, other tables, other queries.
            new_lens = torch.randint(1, s.decode_ctx + 1, (batch,), generator=gen)
            context_lens.copy_(new_lens.to(context_lens.device, torch.int32))
            tables.copy_(tables[torch.randperm(batch, generator=gen).to(tables.device)])
            query.copy_(torch.randn(batch, s.q_heads, s.head_dim, generator=gen).to(s.device, s.dtype))
            graph.replay()
            torch.cuda.synchronize()
            eager = call()
            with early_launch_off():  # the graph's kernels launched early where available
                plain = call()
            # The reference reads every table column: only those a context can reach, or B256 x 128
            # columns would gather over 100 GiB.
            used = -(-s.decode_ctx // s.block_size)
            expected = ref.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables[:, :used],
                                                  context_lens, scale)
            report.check(f"decode in CUDA graph B{batch}{label} (replay == eager)",
                         (static_out.float() - eager.float()).abs().max().item(), 0, exact=True)
            report.check(f"decode in CUDA graph B{batch}{label} (replay == plain launch)",
                         (static_out.float() - plain.float()).abs().max().item(), 0, exact=True)
            report.check(f"decode in CUDA graph B{batch}{label} vs reference", rel_err(static_out, expected), BF16_TOL)
    check_store_then_attend(report, s, gen)


def check_store_then_attend(report: Report, s: Sizes, gen) -> None:
    """The RoPE/store kernel, then decode attention, as a decode step runs them: in a CUDA graph,
    launched early, replayed on new tokens: the plain launches' bits. An attention that read the
    cache before the store had finished would attend to the key the last replay stored."""
    from zipage.kernels import triton_attention, triton_fused

    head_dim, kv_heads, q_heads = s.head_dim, s.kv_heads, s.q_heads
    for lens in ([s.decode_ctx + 5], [s.decode_ctx - 3 * i for i in range(4)], [40 + i for i in range(s.decode_batch)]):
        batch = len(lens)
        k_cache, v_cache, tables = make_paged(lens, s.block_size, kv_heads, head_dim, s.dtype, s.device, gen)
        cpu_tables = tables.cpu()
        slots = torch.tensor([int(cpu_tables[i, (n - 1) // s.block_size]) * s.block_size + (n - 1) % s.block_size
                              for i, n in enumerate(lens)], device=s.device)
        qkv = randn((batch, (q_heads + 2 * kv_heads) * head_dim), gen, s.device, s.dtype)
        angles = torch.rand(batch, head_dim // 2, generator=gen).repeat(1, 2).to(s.device) * 6.28
        cos, sin = angles.cos(), angles.sin()
        context_lens = torch.tensor(lens, dtype=torch.int32, device=s.device)

        def step():
            q = triton_fused.qk_norm_rope_store(qkv, cos, sin, None, None, 0.0, k_cache, v_cache, slots, None, None)
            return triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, context_lens,
                                                           head_dim ** -0.5)

        graph, static_out = bench_common.graph_of(step)
        worst = 0.0
        for _ in range(8):
            qkv.copy_(randn(qkv.shape, gen, s.device, s.dtype))  # new keys and values at the same slots
            graph.replay()
            torch.cuda.synchronize()
            with early_launch_off():
                plain = step()
            worst = max(worst, (static_out.float() - plain.float()).abs().max().item())
        report.check(f"store then decode in a graph, B{batch} (== plain launches)", worst, 0, exact=True,
                     detail="8 replays on new tokens")


# ---------------------------------------------------------------------------------------------
# 2. Engine parity


def _build_tiny_hf(family: str, folder: Path, seed: int):
    """A seeded random transformers model of the preset's shape, saved as an HF folder (fp32)."""
    from zipage.testing import save_random_model

    return save_random_model(folder, family, seed)


@torch.no_grad()
def _hf_generate(model, prompt_ids, new_tokens: int, device) -> list[int]:
    """transformers' greedy generate, EOS disabled (the engine runs with ignore_eos)."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # no early stop, no EOS-dependent processors
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, num_beams=1)
    ids = torch.tensor([list(prompt_ids)], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1]:].tolist()


def check_engine_parity(report: Report, s: Sizes, new_tokens: int | None = None) -> None:
    """Greedy tokens of the engine built with LLM(dir, device="cuda", dtype="float32", compression=False,
    enforce_eager=True) (Triton kernels through the dispatch seam) against transformers' generate on the
    same device, for tiny random Llama, Qwen2 and Qwen3 models. Block size 16 so prompts span several
    blocks; prompts of several lengths in one batch (ragged prefill and decode). On CUDA the Qwen3 model
    also runs with CUDA graphs (enforce_eager=False), which replays the captured Triton decode."""
    from zipage.engine import LLM, SamplingParams

    device = s.device
    new_tokens = new_tokens or s.parity_new_tokens
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 23, 41, 70] if device == "cuda" else [5, 19]
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, family in enumerate(("llama-tiny", "qwen2-tiny", "qwen3-tiny")):
            try:
                folder = Path(tmp) / family
                hf = _build_tiny_hf(family, folder, seed=i).to(device)
                expected = [_hf_generate(hf, prompt, new_tokens, device) for prompt in prompts]
                del hf
            except Exception as exc:  # noqa: BLE001
                report.fail(f"engine parity {family}", exc)
                continue
            variants = [("", dict(enforce_eager=True))]
            if device == "cuda" and family == "qwen3-tiny":
                variants.append((" (CUDA graphs)", dict(enforce_eager=False, max_num_seqs=8)))
            for suffix, knobs in variants:
                name = f"engine parity {family}{suffix}"
                try:
                    with kernel_path("triton", device):
                        llm = LLM(str(folder), device=device, dtype="float32", compression=False,
                                  block_size=16, num_kv_blocks=256, **knobs)
                        try:
                            graphs = getattr(llm.engine.runner, "graphs", None) is not None
                            outs = llm.generate(prompts, params)
                        finally:
                            llm.close()
                    mismatched, first_diff = 0, []
                    for out, want in zip(outs, expected):
                        if out.token_ids != want:
                            mismatched += 1
                            first_diff.append(next((j for j, (a, b) in enumerate(zip(out.token_ids, want)) if a != b),
                                                   min(len(out.token_ids), len(want))))
                    distinct = len({tuple(o.token_ids) for o in outs})
                    report.check(name, float(mismatched), 0,
                                 f"{len(prompts)} prompts x {new_tokens} tokens; distinct outputs {distinct}; "
                                 f"graphs {graphs}" + (f"; first divergence at {first_diff}" if first_diff else ""),
                                 exact=True)
                    if suffix and not graphs:
                        report.checks[-1]["passed"] = False
                        report.checks[-1]["detail"] += " (no CUDA graphs were captured)"
                except Exception as exc:  # noqa: BLE001
                    report.fail(name, exc)


def check_engine_compression(report: Report, s: Sizes) -> None:
    """The engine with compression on (tiny Qwen3, block 16, budget 4 blocks, window 8) on the device:
    Triton path vs reference path, fp32, synchronous compression; tokens should agree."""
    from zipage.engine import LLM, SamplingParams

    device = s.device
    new_tokens = 150 if device == "cuda" else 40
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (9, 30, 70, 100)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=3)
        runs = {}
        for which in ("triton", "reference"):
            with kernel_path(which, device):
                llm = LLM(str(folder), device=device, dtype="float32", compression=True, enforce_eager=True,
                          block_size=16, window=8, max_cache_blocks_per_seq=4, num_kv_blocks=256,
                          async_compress=False)
                try:
                    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
                    compressions = llm.engine.totals.get("compressions", 0)
                finally:
                    llm.close()
            runs[which] = ([o.token_ids for o in outs], compressions)
        (tri, n_tri), (refs, n_ref) = runs["triton"], runs["reference"]
        agree = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(tri, refs)) / sum(len(y) for y in refs)
        lengths_ok = all(len(x) == new_tokens for x in tri)
        report.check("engine with compression: Triton vs reference", 1.0 - agree, 0.1,
                     f"token agreement {agree:.3f}; compressions {n_tri} vs {n_ref}; full length {lengths_ok}")
        if not lengths_ok or n_tri == 0:
            report.checks[-1]["passed"] = False


def check_overlapped_decode(report: Report, s: Sizes) -> None:
    """Overlapped decode steps (step N+1 queued before step N's ids are read) against synchronous
    steps on the device: CUDA graphs, compression on with asynchronous compaction, greedy, seeded
    sampling and early stops. The same requests should get the same tokens."""
    from zipage.engine import LLM, SamplingParams

    device = s.device
    new_tokens = 120 if device == "cuda" else 30
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 17, 40, 64, 90, 9, 33, 21)]
    params = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=new_tokens, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=new_tokens // 3, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=30, max_tokens=new_tokens, ignore_eos=True)] * 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=4)
        runs = {}
        for overlap in (False, True):
            llm = LLM(str(folder), device=device, dtype="float32", compression=True, block_size=16, window=8,
                      max_cache_blocks_per_seq=4, num_kv_blocks=256, overlap_steps=overlap)
            try:
                outs = llm.generate(prompts, params)
                runs[overlap] = ([o.token_ids for o in outs], llm.engine.totals["compressions"],
                                 llm.engine.overlapped_steps)
            finally:
                llm.close()
    overlapped = runs[True][2]
    report_same_tokens(report, "overlapped decode: same tokens as synchronous", runs[False], runs[True],
                       f"{overlapped} steps overlapped", exercised=overlapped > 0)


def check_early_launch(report: Report, s: Sizes) -> None:
    """An engine (tiny Qwen3, CUDA graphs) with every kernel launched the plain way against the same
    engine with early launches: the kernels compute the same bits, so the same requests get the same
    tokens. Twice: fp32 with compression on (asynchronous compaction moves requests between batches
    by timing, which fp32 tokens survive), and bf16 with compression off (batches fixed)."""
    from zipage.engine import LLM, SamplingParams
    from zipage.kernels import early_launch

    if not early_launch.available(torch.device(s.device)):
        report.checks.append(dict(name="early launch: same tokens as plain", metric=0.0, threshold=0.0,
                                  passed=True, detail="skipped (no programmatic dependent launch here)"))
        return
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 40, 90, 17)]
    params = [SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=150, ignore_eos=True)] * 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=6)
        for dtype, compression in (("float32", True), ("bfloat16", False)):
            runs = {}
            for early in (False, True):
                with contextlib.nullcontext() if early else early_launch_off():
                    llm = LLM(str(folder), device=s.device, dtype=dtype, compression=compression, block_size=16,
                              window=8, max_cache_blocks_per_seq=4, num_kv_blocks=256)
                    try:
                        runs[early] = ([o.token_ids for o in llm.generate(prompts, params)],
                                       llm.engine.totals["compressions"])
                    finally:
                        llm.close()
            report_same_tokens(report, f"early launch: same tokens as plain, {dtype}", runs[False], runs[True],
                               "CUDA graphs", exercised=True, compressing=compression)


def check_l2_warm(report: Report, s: Sizes) -> None:
    """Requests one at a time (one-row steps take the skinny products) on the tiny Qwen3, bf16, CUDA
    graphs: with each product's weights warmed in L2 two products ahead by a side stream
    (triton_linear.weight_warmer), the same tokens as without, and the side stream was captured."""
    from zipage.engine import LLM, SamplingParams
    from zipage.kernels import triton_linear

    name = "weights warmed in L2: same tokens as without"
    if s.device != "cuda" or torch.version.hip is not None:
        report.checks.append(dict(name=name, metric=0.0, threshold=0.0, passed=True, detail="skipped (no NVIDIA CUDA)"))
        return
    gen = torch.Generator().manual_seed(22)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (7, 60, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=120, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)]
    committed, runs = triton_linear.WARM_AHEAD, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=7)
        for ahead in (0, 2):
            triton_linear.WARM_AHEAD, forks = ahead, triton_linear.WeightWarmer.forks
            llm = LLM(str(folder), device=s.device, dtype="bfloat16", compression=False, block_size=16,
                      num_kv_blocks=256)
            try:
                tokens = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
            finally:
                llm.close()
                triton_linear.WARM_AHEAD = committed
            runs[ahead] = (tokens, 0, triton_linear.WeightWarmer.forks - forks)
    report_same_tokens(report, name, runs[0], runs[2], f"{runs[2][2]} side-stream forks made",
                       exercised=runs[2][2] > 0, compressing=False)


def report_same_tokens(report: Report, name: str, base, variant, detail: str, exercised: bool,
                       compressing: bool = True) -> None:
    """Two runs of the same requests, (tokens per request, compressions, ...) each: every request's
    tokens must agree, and the variant must have compressed (where compressing) and done what it is
    there to show."""
    same = sum(a == b for a, b in zip(base[0], variant[0]))
    report.check(name, float(len(base[0]) - same), 0, f"{same}/{len(base[0])} requests identical; "
                 f"compressions {base[1]} vs {variant[1]}; {detail}", exact=True)
    if not exercised or (compressing and variant[1] == 0):
        report.checks[-1]["passed"] = False


def check_budgets(report: Report, s: Sizes) -> None:
    """Per-request budgets and elastic budgets on the device (tiny Qwen3, fp32, block 16, window 8):
    a batch of mixed budgets with CUDA graphs (one compression graph per budget class, captured while
    serving) against the same batch run eagerly; elastic budgets with a pool that holds everything
    against full KV; and elastic budgets in a pool too small for full KV, which must compress instead of
    preempting, with the pool invariants checked after every step."""
    from zipage.engine import LLM, SamplingParams

    device = s.device
    new_tokens = 150 if device == "cuda" else 40
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (9, 30, 70, 100, 12, 45)]
    budgets = [1, 2, None, 6, 2, 1]

    def serve(folder, params, check=False, **knobs):
        cfg = dict(device=device, dtype="float32", block_size=16, window=8, max_cache_blocks_per_seq=4)
        cfg.update(knobs)
        llm = LLM(str(folder), **cfg)
        try:
            engine = llm.engine
            seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            done = {}
            while engine.has_work():
                for out in engine.step():
                    if out.finished:
                        done[out.id] = out
                if check:
                    engine.check_invariants()
            graphs = sorted(k[0] // 16 for k in engine.compressor.graphs) if engine.compressor else []
            return [done[q.id].token_ids for q in seqs], dict(engine.totals), graphs
        finally:
            llm.close()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=5)
        mixed = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, kv_budget=b) for b in budgets]
        graphed, totals, graphs = serve(folder, mixed, num_kv_blocks=256)
        eager, eager_totals, _ = serve(folder, mixed, num_kv_blocks=256, enforce_eager=True)
        same = sum(a == b for a, b in zip(graphed, eager))
        report.check("mixed budgets: CUDA graphs vs eager", float(len(prompts) - same), 0,
                     f"{same}/{len(prompts)} identical; compressions {totals['compressions']} vs "
                     f"{eager_totals['compressions']}; graph budget classes {sorted(set(graphs))}", exact=True)
        if totals["compressions"] == 0 or len(set(graphs)) < 3:
            report.checks[-1]["passed"] = False

        plain = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, kv_budget=b) for b in budgets]
        elastic, e_totals, _ = serve(folder, plain, num_kv_blocks=256, budget_policy="elastic")
        full, _, _ = serve(folder, [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)] * len(prompts),
                           num_kv_blocks=256, compression=False)
        same = sum(a == b for a, b in zip(elastic, full))
        report.check("elastic, pool with room: same tokens as full KV", float(len(prompts) - same), 0,
                     f"{same}/{len(prompts)} identical; compressions {e_totals['compressions']}", exact=True)
        if e_totals["compressions"]:
            report.checks[-1]["passed"] = False

        tight = -(-(100 + new_tokens) // 16) + 8  # the longest request in full plus a little
        short, t_totals, _ = serve(folder, plain, check=True, num_kv_blocks=tight, budget_policy="elastic")
        whole = all(len(t) == new_tokens for t in short)
        report.check("elastic, short pool: compress, never preempt", float(t_totals["preemptions"]), 0,
                     f"pool {tight} blocks; pool compressions {t_totals['pool_compressions']}; "
                     f"preemptions {t_totals['preemptions']}; every request full length {whole}", exact=True)
        if not whole or t_totals["pool_compressions"] == 0:
            report.checks[-1]["passed"] = False


def check_mixed_steps(report: Report, s: Sizes) -> None:
    """Mixed steps on the device (tiny Qwen3, fp32, compression on, CUDA graphs and overlapped decode
    where they apply): long prompts arrive while others decode, in a small step budget, so decode tokens
    and prefill chunks share forwards (decode attention for the decoders, prefill attention for the
    chunks). The same requests served with steps that are all prefill or all decode should get the
    same tokens."""
    from zipage.engine import LLM, SamplingParams

    device = s.device
    new_tokens = 120 if device == "cuda" else 30
    gen = torch.Generator().manual_seed(14)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 17, 300, 40, 500, 9, 260, 33)]
    params = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=6)
        runs = {}
        for mixed in (False, True):
            llm = LLM(str(folder), device=device, dtype="float32", compression=True, block_size=16, window=8,
                      max_cache_blocks_per_seq=4, num_kv_blocks=256, max_num_batched_tokens=64, mixed_steps=mixed)
            mixed_forwards, launch = [0], llm.engine.runner.launch

            def counting(batch, *rest, launch=launch, count=mixed_forwards):
                count[0] += batch.is_mixed
                return launch(batch, *rest)

            llm.engine.runner.launch = counting
            try:
                engine, outs = llm.engine, {}
                seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
                while engine.has_work():  # the long prompts come once the first ones decode
                    for out in engine.step():
                        if out.finished:
                            outs[out.id] = out
                    if len(seqs) < len(prompts) and all(q.num_output_tokens > 3 for q in seqs[:2]):
                        seqs += [engine.add_request(p, sp) for p, sp in zip(prompts[4:], params[4:])]
                runs[mixed] = ([outs[q.id].token_ids for q in seqs], engine.totals["compressions"], mixed_forwards[0])
            finally:
                llm.close()
    forwards = runs[True][2]
    report_same_tokens(report, "mixed steps: same tokens as split steps", runs[False], runs[True],
                       f"{forwards} mixed forwards", exercised=forwards > 0)


def _on_device_and_cpu(s: Sizes, seed: int, run, **knobs) -> dict:
    """{device: run(llm)} for the device and the CPU, each an engine on the same tiny Qwen3 (fp32,
    compression on, block 16, window 8, 4-block budgets; CUDA graphs and overlapped steps on the GPU),
    with these engine knobs on top."""
    from zipage.engine import LLM

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-tiny"
        _build_tiny_hf("qwen3-tiny", folder, seed=seed)
        for device in dict.fromkeys([s.device, "cpu"]):
            llm = LLM(str(folder), device=device, dtype="float32", compression=True, block_size=16, window=8,
                      max_cache_blocks_per_seq=4, num_kv_blocks=256, **knobs)
            try:
                runs[device] = run(llm)
            finally:
                llm.close()
    return runs


def check_logprobs_and_penalties(report: Report, s: Sizes) -> None:
    """Log-probabilities and penalties on the device (tiny Qwen3, fp32, compression on, CUDA graphs and
    overlapped decode) against the same requests on the CPU's PyTorch path: the same greedy tokens,
    asking for log-probabilities changes none of them, and their values agree."""
    from zipage.engine import SamplingParams

    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (7, 40, 130, 300)]
    plain = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    penalised = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, frequency_penalty=0.5,
                               presence_penalty=0.3)
    def run(llm):
        outs = {name: llm.generate(prompts, [params] * len(prompts))
                for name, params in (("plain", plain), ("asking", asking), ("penalised", penalised))}
        return {**outs, "compressions": llm.engine.totals["compressions"]}

    runs = _on_device_and_cpu(s, 8, run)
    dev, cpu = runs[s.device], runs["cpu"]
    tokens = lambda run, name: [o.token_ids for o in run[name]]  # noqa: E731
    report_same_tokens(report, "logprobs asked: same tokens as not asked",
                       (tokens(dev, "plain"), dev["compressions"]), (tokens(dev, "asking"), dev["compressions"]),
                       s.device, exercised=True)
    report_same_tokens(report, f"penalties: {s.device} tokens as the CPU's", (tokens(cpu, "penalised"), 1),
                       (tokens(dev, "penalised"), dev["compressions"]), "frequency 0.5, presence 0.3", exercised=True)
    worst, count = 0.0, 0
    for a, b in zip(dev["asking"], cpu["asking"]):
        if a.token_ids != b.token_ids:
            continue
        for x, y in zip(a.logprobs, b.logprobs):
            worst = max(worst, abs(x.logprob - y.logprob), *(abs(x.top[t] - y.top[t]) for t in x.top if t in y.top))
            count += 1
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            worst = max(worst, abs(x.logprob - y.logprob))
            count += 1
    greedy_first = all(x.rank == 1 for o in dev["asking"] for x in o.logprobs)
    report.check(f"logprobs: {s.device} against the CPU (fp32)", worst if greedy_first and count else float("inf"),
                 1e-3, f"{count} positions compared; every greedy token ranked first: {greedy_first}")


def check_structured_output(report: Report, s: Sizes) -> None:
    """Structured output on the device (tiny Qwen3, fp32, compression, CUDA graphs and overlapped decode):
    requests under a JSON schema, greedy and seeded, beside free ones. The free ones get the tokens they
    get without the constrained ones beside them, the constrained ones parse and match the schema and get
    the CPU's greedy tokens; the token mask unpacked on the device equals the host's, and its time."""
    from zipage.engine import SamplingParams
    from zipage.engine.execution.grammar_masks import mask_rows, unpack_on_device, unpack_on_host

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"enum": [1, 3, 7]}}}
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (9, 40, 130, 70)]
    free = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    shaped = [SamplingParams(temperature=0.0, max_tokens=80, json_schema=schema),
              SamplingParams(temperature=1.0, seed=3, max_tokens=80, json_schema=schema)]
    def run(llm):
        alone = llm.generate(prompts, [free] * len(prompts))
        mixed = llm.generate(prompts + prompts[:2], [free] * len(prompts) + shaped)
        return ([o.token_ids for o in alone], [o.token_ids for o in mixed[:len(prompts)]], mixed[len(prompts):],
                llm.engine.totals["compressions"], llm.engine.overlapped_steps)

    runs = _on_device_and_cpu(s, 9, run)
    alone, beside, constrained, compressions, overlapped = runs[s.device]
    report_same_tokens(report, "structured: free requests untouched", (alone, compressions), (beside, compressions),
                       f"{overlapped} steps overlapped", exercised=True)
    valid = 0
    for out in constrained:
        try:
            value = json.loads(out.text)
            valid += value["city"] in ("Paris", "Oslo", "Lima") and value["days"] in (1, 3, 7) and len(value) == 2
        except (ValueError, KeyError, TypeError):
            pass
    report.check("structured: outputs parse and match the schema", float(len(constrained) - valid), 0,
                 f"{valid}/{len(constrained)}: {[o.text for o in constrained]}", exact=True)
    report.check("structured: greedy tokens as the CPU's", float(constrained[0].token_ids != runs["cpu"][2][0].token_ids),
                 0, s.device, exact=True)
    if s.device != "cuda":
        return
    vocab = 151936
    for rows in (1, 8, 64):
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32,
                                generator=gen).pin_memory()
        logits = torch.randn(rows, vocab, device="cuda")
        same = torch.equal(unpack_on_device(bitmask, torch.device("cuda")).cpu(), unpack_on_host(bitmask))
        report.check(f"structured: mask unpacked on the device, {rows} rows", float(not same), 0, exact=True)
        report.time(f"structured: mask_rows, {rows} rows of {vocab}",
                    bench_ms(lambda: mask_rows(logits, list(range(rows)), bitmask), "cuda"))


# ---------------------------------------------------------------------------------------------
# 3. Timings


# ---------------------------------------------------------------------------------------------
# 8-bit KV: fp8 and int8 codes (docs/design-notes.md, "KV in 8 bits")


CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _coded_paged(lens, s: Sizes, head_dim: int, gen, codes: torch.dtype, extra_cols: int = 1):
    """Paged caches of these lengths quantized to 8-bit codes: (k codes, v codes, k scales, v scales,
    tables, (the keys and values before quantization))."""
    k_cache, v_cache, tables = make_paged(lens, s.block_size, s.kv_heads, head_dim, s.dtype, s.device, gen,
                                          extra_cols=extra_cols)
    k_cache = k_cache * 3  # keys of a few units, as models have
    k_codes, k_scales = ref.quantize_rows(k_cache, codes)
    v_codes, v_scales = ref.quantize_rows(v_cache, codes)
    return k_codes, v_codes, k_scales, v_scales, tables, (k_cache, v_cache)


def check_codes(report: Report, s: Sizes, gen, name: str):
    """An 8-bit cache's kernels (name: fp8 or int8) against the reference on the same codes and
    scales: the stores (codes and scales of each entry), compaction (bit-exact moves), the gather
    that feeds the redundancy score (bit-exact dequantized values), decode and
    prefill attention and the window score (on dequantized values); and how far its attention lies
    from attention over the unquantized K/V."""
    from zipage.kernels import triton_attention, triton_cache, triton_fused, triton_scores

    dev, dt = s.device, s.dtype
    fp8 = CODE_DTYPES[name]
    tol = BF16_TOL if dt != torch.float32 else FP32_TOL

    def stores():
        tokens = 3 * s.block_size // 2
        blocks = 8
        shape = (blocks, s.block_size, s.kv_heads, s.head_dim)
        slots = torch.randperm(blocks * s.block_size, generator=gen)[:tokens]
        slots[::7] = -1
        slots = slots.to(dev)
        key, value = randn((tokens, s.kv_heads, s.head_dim), gen, dev, dt) * 4, randn((tokens, s.kv_heads, s.head_dim), gen, dev, dt)
        key[0, 0] = 0  # an all-zero row
        caches = [[torch.zeros(shape, dtype=fp8, device=dev) for _ in range(2)]
                  + [torch.zeros(shape[:-1], device=dev) for _ in range(2)] for _ in range(2)]
        ref.store_kv(key, value, caches[0][0], caches[0][1], slots, k_scales=caches[0][2], v_scales=caches[0][3])
        triton_cache.store_kv(key, value, caches[1][0], caches[1][1], slots, k_scales=caches[1][2], v_scales=caches[1][3])
        codes = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(caches[0][:2], caches[1][:2]))
        # torch's CUDA division and Triton's IEEE one can part by an ulp, and a code at a rounding
        # boundary with it: codes one step apart, rarely (measured: int8 91 of 393,216 on an H200,
        # fp8 1 of 786,432 on an H100). Neighbouring e4m3 codes of one sign are neighbouring bytes.
        step = (lambda t: t.view(torch.uint8).int()) if name == "fp8" else (lambda t: t.int())
        steps = max(int((step(a) - step(b)).abs().max()) for a, b in zip(caches[0][:2], caches[1][:2]))
        total = 2 * tokens * s.kv_heads * s.head_dim
        report.check(f"{name} store_kv: codes", float(codes) / total, 1e-3,
                     f"{tokens} tokens: {codes} of {total} codes differ, by at most {steps} step(s)")
        report.check(f"{name} store_kv: code steps", float(steps), 1.5, "largest difference, in codes (at most 1)")
        report.check(f"{name} store_kv: scales", max(rel_err(b, a) for a, b in zip(caches[0][2:], caches[1][2:])), 1e-6)
        # The fused QK-norm + RoPE + store, against the reference on the same bf16 inputs.
        width = (s.q_heads + 2 * s.kv_heads) * s.head_dim
        qkv = randn((tokens, width), gen, dev, dt) * 2
        angles = torch.rand(tokens, s.head_dim // 2, generator=gen).to(dev) * 6.28
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        norm_w = (randn((s.head_dim,), gen, dev) * 0.1 + 1).to(dt)
        fused = [[torch.zeros(shape, dtype=fp8, device=dev) for _ in range(2)]
                 + [torch.zeros(shape[:-1], device=dev) for _ in range(2)] for _ in range(2)]
        for impl, (kc, vc, ks, vs) in ((ref.qk_norm_rope_store, fused[0]), (triton_fused.qk_norm_rope_store, fused[1])):
            impl(qkv, cos, sin, norm_w, norm_w, 1e-6, kc, vc, slots, None, None, k_scales=ks, v_scales=vs,
                 hadamard_qk=name == "int8")  # as the engine stores an int8 cache
        values = [ref.dequantize(c, sc) for c, sc in ((fused[0][0], fused[0][2]), (fused[1][0], fused[1][2]))]
        report.check(f"{name} qk_norm_rope_store: keys", rel_err(values[1], values[0]), 0.07,
                     "dequantized keys, Triton against the reference (one code step where bf16 rounding differs)")

    def compaction():
        n = s.budget_blocks
        kv_len, keep = (n + 1) * s.block_size, n * s.block_size
        k_codes, v_codes, k_scales, v_scales, tables, _ = _coded_paged([kv_len], s, s.head_dim, gen, fp8, extra_cols=0)
        table = tables[0].long()
        token_slots = (table[:, None] * s.block_size + torch.arange(s.block_size, device=dev)[None, :]).flatten()
        src = token_slots[ref.keep_indices(torch.randn(s.kv_heads, kv_len, generator=gen).to(dev), keep)]
        dst = token_slots[:keep].clone()
        expected = [t.clone() for t in (k_codes, v_codes, k_scales, v_scales)]
        ref.compact_kv(expected[0], expected[1], None, src, dst, None, k_scales=expected[2], v_scales=expected[3])
        triton_cache.compact_kv(k_codes, v_codes, None, src, dst, None, k_scales=k_scales, v_scales=v_scales)
        moved = (k_codes, v_codes, k_scales, v_scales)
        diff = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype == fp8
                   else int((a != b).sum()) for a, b in zip(moved, expected))
        report.check(f"{name} compact_kv (overlapping)", float(diff), 0, f"{kv_len} -> {keep} entries, codes and scales",
                     exact=True)

    def gather():
        kv_len = (s.budget_blocks + 1) * s.block_size - 3
        k_codes, _, k_scales, _, tables, (keys, _) = _coded_paged([kv_len], s, s.head_dim, gen, fp8, extra_cols=0)
        table = tables[0].long()
        diff = 0
        for codes, scales in ((k_codes, k_scales), (keys, None)):  # the codes, and the model-dtype cache
            out = triton_cache.gather_kv(codes, table, kv_len, scales, dt)
            expected = ref.gather_kv(codes, table, kv_len, scales, dt)
            diff += int((out != expected).sum())
        report.check(f"{name} gather_kv", float(diff), 0, f"{kv_len} entries dequantized into {dt}, and the {dt} cache",
                     exact=True)

    def decode(label, lens, ways=None, launch=None):
        k_codes, v_codes, k_scales, v_scales, tables, (keys, values) = _coded_paged(lens, s, s.head_dim, gen, fp8)
        query = randn((len(lens), s.q_heads, s.head_dim), gen, dev, dt)
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        scale = s.head_dim ** -0.5
        out = triton_attention.paged_decode_attention_impl(query, k_codes, v_codes, tables, ctx, scale,
                                                           num_partitions=ways, k_scales=k_scales, v_scales=v_scales,
                                                           launch=launch)
        expected = ref.paged_decode_attention(query.float(), k_codes, v_codes, tables, ctx, scale,
                                              k_scales=k_scales, v_scales=v_scales)
        report.check(label, rel_err(out, expected), tol, f"B={len(lens)} max_ctx={max(lens)}")
        unquantized = ref.paged_decode_attention(query.float(), keys.float(), values.float(), tables, ctx, scale)
        report.check(f"{label}: against unquantized K/V", rel_err(out, unquantized), 0.1,
                     "the codes' rounding of keys and values")

    def prefill():
        q_lens = torch.randint(s.prefill_q[0], s.prefill_q[1] + 1, (s.prefill_seqs,), generator=gen).tolist()
        prefixes = torch.randint(s.prefill_prefix[0], s.prefill_prefix[1] + 1, (s.prefill_seqs,), generator=gen).tolist()
        lens = [q + p for q, p in zip(q_lens, prefixes)]
        k_codes, v_codes, k_scales, v_scales, tables, _ = _coded_paged(lens, s, s.head_dim, gen, fp8)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        query = randn((sum(q_lens), s.q_heads, s.head_dim), gen, dev, dt)
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        scale = s.head_dim ** -0.5
        out = triton_attention.prefill_attention(query, k_codes, v_codes, tables, cu, ctx, scale,
                                                 k_scales=k_scales, v_scales=v_scales)
        expected = ref.prefill_attention(query.float(), k_codes, v_codes, tables, cu, ctx, scale,
                                         k_scales=k_scales, v_scales=v_scales)
        report.check(f"{name} prefill attention", rel_err(out, expected), tol, f"{len(lens)} seqs, {sum(q_lens)} new tokens")

    def window():
        kv_len = (s.budget_blocks + 1) * s.block_size
        k_codes, _, k_scales, _, tables, _ = _coded_paged([kv_len], s, s.head_dim, gen, fp8, extra_cols=0)
        queries = randn((s.window, s.q_heads, s.head_dim), gen, dev, dt)
        scale = s.head_dim ** -0.5
        out = triton_scores.window_attention_score(queries, k_codes, tables[0].long(), kv_len, scale, k_scales=k_scales)
        expected = ref.window_attention_score(queries.float(), k_codes, tables[0].long(), kv_len, scale, k_scales=k_scales)
        report.check(f"{name} window_attention_score", rel_err(out, expected), tol, f"kv_len={kv_len}")

    def timing():
        """Decode attention over the loaded shape (batch 64 x 2000 tokens), bf16 cache against 8-bit codes."""
        if torch.device(dev).type != "cuda":
            return
        lens = [2000] * 64
        k_codes, v_codes, k_scales, v_scales, tables, (k_bf16, v_bf16) = _coded_paged(lens, s, s.head_dim, gen, fp8)
        query = randn((len(lens), s.q_heads, s.head_dim), gen, dev, dt)
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        scale = s.head_dim ** -0.5
        fp8_call = lambda: triton_attention.paged_decode_attention(  # noqa: E731
            query, k_codes, v_codes, tables, ctx, scale, k_scales=k_scales, v_scales=v_scales)
        report.time("decode attention bf16 B64 x 2000", bench_ms(
            lambda: triton_attention.paged_decode_attention(query, k_bf16, v_bf16, tables, ctx, scale), dev))
        report.time(f"decode attention {name} B64 x 2000", bench_ms(fp8_call, dev))

    report.attempt(f"{name} stores", stores)
    report.attempt(f"{name} compaction", compaction)
    report.attempt(f"{name} gather", gather)
    report.attempt(f"{name} decode", decode, f"{name} decode B{s.decode_batch}", torch.randint(
        1, s.decode_ctx + 1, (s.decode_batch,), generator=gen).tolist())
    report.attempt(f"{name} decode split", decode, f"{name} decode B1 ctx{s.long_ctx} (split-K)", [s.long_ctx])
    # the launch option that converts codes through PTX (off in the engine; triton_attention.codes_as)
    ptx = triton_attention.decode_launch(fp8).with_ptx_codes()
    report.attempt(f"{name} decode, PTX codes", decode, f"{name} decode B{s.decode_batch}, PTX codes",
                   torch.randint(1, s.decode_ctx + 1, (s.decode_batch,), generator=gen).tolist(), None, ptx)
    report.attempt(f"{name} decode split, PTX codes", decode, f"{name} decode B1 ctx{s.long_ctx} (split-K), PTX codes",
                   [s.long_ctx], None, ptx)
    bulk = bulk_copy_launch(fp8)
    report.attempt(f"{name} decode, bulk copies", decode, f"{name} decode B{s.decode_batch}, bulk copies",
                   torch.randint(1, s.decode_ctx + 1, (s.decode_batch,), generator=gen).tolist(), None, bulk)
    report.attempt(f"{name} decode split, bulk copies", decode,
                   f"{name} decode B1 ctx{s.long_ctx} (split-K), bulk copies", [s.long_ctx], None, bulk)
    report.attempt(f"{name} prefill", prefill)
    report.attempt(f"{name} window score", window)
    report.attempt(f"{name} timing", timing)


def check_codes_engine(report: Report, s: Sizes, name: str) -> None:
    """The engine with an 8-bit cache (name: fp8 or int8) on the device (tiny Qwen3, fp32, compression,
    CUDA graphs and overlapped decode) against the same requests on the CPU's PyTorch path: greedy
    tokens agree until a rounding flips a near-tie, and compressions run."""
    from zipage.engine import SamplingParams

    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (7, 40, 130, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    def run(llm):
        return {"tokens": [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))],
                "compressions": llm.engine.totals["compressions"]}

    runs = _on_device_and_cpu(s, 9, run, kv_cache_dtype=name)
    dev, cpu = runs[s.device], runs["cpu"]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(dev["tokens"], cpu["tokens"])]
    report.check(f"{name} engine: {s.device} tokens as the CPU's", float(sum(len(t) for t in dev["tokens"]) - sum(agree)),
                 0.25 * sum(len(t) for t in dev["tokens"]),
                 f"tokens agreeing before the first difference per request {agree}; compressions {dev['compressions']} "
                 f"({s.device}) {cpu['compressions']} (cpu)")


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    if torch.device(device).type != "cuda":
        return float("nan")
    n = 1 << 30  # 1 GiB per buffer
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    del src, dst
    return 2 * n / (ms * 1e-3)


def time_kernels(report: Report, s: Sizes, gen):
    from zipage.kernels import triton_attention

    dev = s.device
    bw = copy_bandwidth(dev)
    report.time("device-to-device copy (1 GiB)", 2 * (1 << 30) / bw * 1e3 if bw == bw else float("nan"),
                GBps=bw / 1e9)
    report.sections["copy_bandwidth_GBps"] = bw / 1e9
    scale = s.head_dim ** -0.5
    elem = torch.finfo(s.dtype).bits // 8
    wide = s.long_ctx // s.block_size
    budget_ctx = (s.budget_blocks + 1) * s.block_size
    # (batch, context, table width): a full batch; one long request (split-K); a few compressed
    # requests in a table as wide as the engine's CUDA graphs use (split by their own length).
    for batch, ctx, width in ((s.decode_batch, s.decode_ctx, s.decode_ctx // s.block_size), (1, s.long_ctx, wide),
                              (16, budget_ctx, wide)):
        lens = [ctx] * batch
        k_cache, v_cache, tables = make_paged(lens, s.block_size, s.kv_heads, s.head_dim, s.dtype, dev, gen,
                                              extra_cols=max(0, width - -(-ctx // s.block_size)))
        query = torch.randn(batch, s.q_heads, s.head_dim, generator=gen).to(dev, s.dtype)
        context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        ms = bench_ms(lambda: triton_attention.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale), dev)
        kv_bytes = 2 * batch * ctx * s.kv_heads * s.head_dim * elem
        achieved = kv_bytes / (ms * 1e-3)
        ways = triton_attention.decode_num_partitions(batch, s.kv_heads, tables.shape[1], s.block_size, query.device)
        report.time(f"decode attention B{batch} x {ctx} (table {tables.shape[1]} blocks)", ms, GBps=achieved / 1e9,
                    of_copy_bw=achieved / bw if bw == bw else float("nan"), KV_MB=kv_bytes / 1e6,
                    partitions=ways)
        if batch == s.decode_batch and torch.device(dev).type == "cuda":
            ref_ms = bench_ms(lambda: ref.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale), dev)
            report.time(f"  reference decode B{batch} x {ctx} (torch)", ref_ms)
        del k_cache, v_cache

    q_lens = [s.prefill_q[1]] * s.prefill_seqs
    prefixes = [s.prefill_prefix[1]] * s.prefill_seqs
    lens = [q + p for q, p in zip(q_lens, prefixes)]
    k_cache, v_cache, tables = make_paged(lens, s.block_size, s.kv_heads, s.head_dim, s.dtype, dev, gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    query = torch.randn(sum(q_lens), s.q_heads, s.head_dim, generator=gen).to(dev, s.dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    ms = bench_ms(lambda: triton_attention.prefill_attention(query, k_cache, v_cache, tables, cu, context_lens, scale), dev)
    flops = sum(4 * q * (p + (q + 1) / 2) * s.q_heads * s.head_dim for q, p in zip(q_lens, prefixes))
    report.time(f"prefill attention {s.prefill_seqs} x ({prefixes[0]} cached + {q_lens[0]} new)", ms,
                TFLOPs=flops / (ms * 1e-3) / 1e12)
    del k_cache, v_cache


def time_compression(report: Report, s: Sizes, gen):
    """One full compression of a full-budget request ((n+1) blocks -> n) over every layer: window
    scores, pooling, global merge, lightning redundancy, keep set and compaction (engine.compressor)."""
    num_blocks = s.budget_blocks + 4
    runner = _fake_runner(s, gen, num_blocks)
    compressor = _compressor(s, runner)
    job = _compression_job(s, gen, num_blocks, first=True)
    label = f"{s.budget_blocks + 1}x{s.block_size} -> {s.budget_blocks} blocks, {s.layers} layers"
    for which in ("triton", "reference"):
        with kernel_path(which, s.device):
            ms = bench_ms(lambda: compressor.execute(job), s.device)
        report.time(f"compression ({which}) {label}", ms, per_layer_ms=ms / s.layers)
    if s.device != "cpu":  # the engine replays a captured graph of the whole pipeline
        with kernel_path("triton", s.device):
            compressor.capture_graphs()
            ms = bench_ms(lambda: compressor.execute(job), s.device)
        report.time(f"compression (triton, CUDA graph) {label}", ms, per_layer_ms=ms / s.layers)


# ---------------------------------------------------------------------------------------------


def env_info(s: Sizes) -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__, interpret=os.environ.get("TRITON_INTERPRET"),
                registered=list(triton_ops.REGISTERED), import_error=repr(triton_ops.IMPORT_ERROR))
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        info["triton"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_GiB=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU with TRITON_INTERPRET=1")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: "
                        "cache,decode,prefill,scores,pipeline,graph,fused,skinny,sampling,parity,compression_engine,overlap,early,budgets,mixed,"
                        "logprobs,structured,fp8,timing")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="start no new section after this many seconds (default 400)")
    parser.add_argument("--skinny-table", default=None, help="skinny_table.json of a gpu_skinny.py run, "
                        "checked in place of the committed table")
    bench_common.add_decode_launch_flag(parser)
    args = parser.parse_args(argv)
    launches = bench_common.set_decode_launches(args.decode_launch) if args.decode_launch else None
    if args.skinny_table:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_skinny import load_table

        load_table(args.skinny_table)
    s = SMOKE if args.smoke else FULL
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        print("CUDA is not available: run with --smoke on a CPU", file=sys.stderr)
        return 2
    report = Report()
    started = time.perf_counter()
    info = env_info(s)
    print(json.dumps(info, indent=1), flush=True)
    if torch.cuda.is_available() and not args.smoke:
        name = "Triton implementations registered for CUDA"
        report.check(name, float(len(set(NAMES) - set(kernels.TRITON_IMPLS))), 0,
                     f"{len(kernels.TRITON_IMPLS)}/{len(NAMES)}", exact=True)

    sections = [
        ("cache", "cache ops", check_cache_ops),
        ("decode", "decode attention", check_decode),
        ("prefill", "prefill attention", check_prefill),
        ("scores", "scores and keep set", check_scores),
        ("pipeline", "compression pipeline", check_compression_pipeline),
        ("graph", "CUDA graph", check_cuda_graph),
        ("fused", "fused layer chains", check_fused),
        ("skinny", "skinny decode products", check_skinny),
        ("sampling", "sampling", check_sampling),
        ("fp8", "fp8 KV kernels", lambda r, sz, g: check_codes(r, sz, g, "fp8")),
        ("int8", "int8 KV kernels", lambda r, sz, g: check_codes(r, sz, g, "int8")),
    ]
    seed = iter(range(1, 1000))
    plan = [(key, title, (lambda fn=fn: fn(report, s, torch.Generator().manual_seed(next(seed)))))
            for key, title, fn in sections]
    plan += [
        ("parity", "engine parity (greedy, fp32) vs transformers", lambda: check_engine_parity(report, s)),
        ("compression_engine", "engine with compression: Triton vs reference", lambda: check_engine_compression(report, s)),
        ("overlap", "overlapped decode vs synchronous steps", lambda: check_overlapped_decode(report, s)),
        ("early", "early launch vs plain launch", lambda: check_early_launch(report, s)),
        ("early", "weights warmed in L2 vs not", lambda: check_l2_warm(report, s)),
        ("budgets", "per-request and elastic budgets", lambda: check_budgets(report, s)),
        ("mixed", "mixed prefill and decode steps", lambda: check_mixed_steps(report, s)),
        ("logprobs", "log-probabilities and penalties", lambda: check_logprobs_and_penalties(report, s)),
        ("structured", "structured output", lambda: check_structured_output(report, s)),
        ("fp8", "fp8 KV engine", lambda: check_codes_engine(report, s, "fp8")),
        ("int8", "int8 KV engine", lambda: check_codes_engine(report, s, "int8")),
        ("timing", "timings: kernels (median ms)", lambda: time_kernels(report, s, torch.Generator().manual_seed(99))),
        ("timing", "timings: compression (median ms)",
         lambda: time_compression(report, s, torch.Generator().manual_seed(98))),
    ]
    for key, title, run in plan:
        if key in skip:
            continue
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            report.sections[f"section {title}"] = dict(skipped=f"time budget ({elapsed:.0f} s > {args.budget_s} s)")
            print(f"\n== {title}: skipped, time budget spent", flush=True)
            continue
        print(f"\n== {title}", flush=True)
        guarded(report, f"section {title}")(run)()

    failed = [c for c in report.checks if not c["passed"]]
    print(f"\n{'=' * 100}\n{'result':6s}  {'check':44s} {'metric':>10s}  detail")
    for c in report.checks:
        metric = c["metric"]
        print(f"{'PASS' if c['passed'] else 'FAIL':6s}  {c['name']:44s} {metric:10.3e}  {c['detail'][:120]}")
    total = time.perf_counter() - started
    print(f"\n{len(report.checks) - len(failed)}/{len(report.checks)} checks passed in {total:.0f} s")
    result = dict(env=info, smoke=args.smoke, decode_launches=launches, seconds=round(total, 1), passed=not failed,
                  checks=report.checks, timings=report.timings, sections=report.sections)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
