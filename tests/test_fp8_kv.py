"""KV in 8 bits (docs/design-notes.md, "KV in 8 bits"): the engine stores K and V as float8 codes
with a scale per entry and KV head. The pool sizes itself by bytes, outputs do not depend on the
batch, compressed requests keep their bound, and the attention follows the unquantized model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compression_helpers import assert_drained, build_random_model, greedy, make_engine, random_prompts, run
from zipage import LLM, SamplingParams
from zipage.engine import EngineConfig

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-fp8"), "qwen3-tiny", seed=11)


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8': must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8")
    cli = subprocess.run([sys.executable, "-m", "zipage.cli.main", "generate", "--model", "random:llama-tiny",
                          "--device", "cpu", "--kv-cache-dtype", "e5m2", "hi"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert cli.returncode == 2 and "kv_cache_dtype='e5m2': must be one of auto, fp8" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_the_pool_holds_blocks_by_bytes(model_path):
    """The same kv_cache_gb holds about four times the fp32 blocks (twice bf16's): one byte per value
    plus a float32 scale per entry and head, and the pool never exceeds what it was given."""
    engines = {dtype: make_engine(model_path, kv_cache_dtype=dtype, kv_cache_gb=0.002, num_kv_blocks=None)
               for dtype in ("auto", "fp8")}
    try:
        full, fp8 = engines["auto"].runner, engines["fp8"].runner
        assert full.kv_cache.dtype == torch.float32 and fp8.kv_cache.dtype == torch.float8_e4m3fn
        assert fp8.kv_scales.shape == fp8.kv_cache.shape[:-1] and full.kv_scales is None
        layers, heads, dim, bs = fp8.num_layers, fp8.num_kv_heads, fp8.head_dim, fp8.block_size
        extra = 12 * heads  # score, position and choice per entry and head under compression
        assert full.block_bytes == layers * bs * (2 * heads * dim * 4 + extra)
        assert fp8.block_bytes == layers * bs * (2 * heads * (dim + 4) + extra)
        budget = int(0.002 * (1 << 30))
        for runner in (full, fp8):
            assert runner.kv_bytes <= budget
            assert budget - runner.kv_bytes < runner.block_bytes + runner.query_slot_bytes * runner.num_query_slots
        assert fp8.num_blocks / full.num_blocks > 2.0  # head_dim 16 here: the scales cost a fifth
        assert engines["fp8"].snapshot().memory.kv_dtype == "fp8"
        assert engines["auto"].snapshot().memory.kv_dtype == "fp32"
    finally:
        for engine in engines.values():
            engine.close()


def test_compressed_fp8_outputs_do_not_depend_on_the_batch(model_path):
    """One request alone and beside three others, each compressed several times: the same tokens,
    the bound and the pool's accounting checked after every step, nothing left held."""
    prompts = random_prompts(4, [20, 37, 9, 60], seed=3)
    engine = make_engine(model_path, kv_cache_dtype="fp8", num_kv_blocks=64)
    try:
        seqs = [engine.add_request(p, greedy(120)) for p in prompts]
        together = run(engine)
        assert all(s.times_compressed >= 3 for s in seqs)
        assert_drained(engine)
        for seq, prompt in zip(seqs, prompts):
            alone = engine.add_request(prompt, greedy(120))
            assert run(engine)[alone.id].token_ids == together[seq.id].token_ids
        assert_drained(engine)
    finally:
        engine.close()


def test_fp8_prompt_distribution_follows_the_unquantized_cache(smol):
    """SmolLM2 reading real text through an fp8 cache ranks the next token as the fp32 cache does
    wherever the fp32 cache's choice is clear (e4m3 keeps 3 mantissa bits: only near-ties may flip),
    and its log-probabilities stay close."""
    text = ("The river rose through the night, and by morning the low fields were under water. "
            "Farmers moved their animals to the hills, while the village council met in the school "
            "to decide who would guard the bridge. Nobody had seen a flood like it in forty years, "
            "and the old miller said the last one had taken his father's barn and half the orchard.")
    ids = smol.tokenizer.encode(text)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    reference = smol.generate([ids], params)[0].prompt_logprobs[1:]
    fp8 = LLM("smollm2-135m", device="cpu", compression=False, num_kv_blocks=64, weight_dtype="float32",
              kv_cache_dtype="fp8")
    try:
        quantized = fp8.generate([ids], params)[0].prompt_logprobs[1:]
    finally:
        fp8.close()
    clear = 0
    for position, (a, b) in enumerate(zip(reference, quantized)):
        (top, first), (_, second) = a.top.items()
        if first - second > 0.5:  # a lead of more than half a nat
            clear += 1
            assert next(iter(b.top)) == top, f"position {position}: fp8 chose another token"
    assert clear >= len(reference) // 2
    drift = max(abs(a.logprob - b.logprob) for a, b in zip(reference, quantized))
    assert 0 < drift < 0.5, drift  # the cache really was fp8, and stays close


def test_the_consoles_kv_gauge_names_the_cache_dtype(model_path):
    from zipage.cli.console.widgets import Gauges

    for dtype, label in (("fp8", "KV fp8"), ("auto", "KV fp32")):
        engine = make_engine(model_path, kv_cache_dtype=dtype)
        try:
            gauges = Gauges()
            gauges.show(engine.snapshot())
            assert gauges.kv.label == label
        finally:
            engine.close()
