"""KV in 8 bits (docs/design-notes.md, "KV in 8 bits"): the engine stores K and V as 8-bit codes,
float8_e4m3fn ("fp8") or symmetric int8 ("int8"), with a scale per entry and KV head. The pool sizes
itself by bytes, outputs do not depend on the batch, compressed requests keep their bound, and the
attention follows the unquantized model. Each behaviour is checked for both formats (KV_8BIT)."""

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
KV_8BIT = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}  # kv_cache_dtype -> the codes' dtype


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-fp8"), "qwen3-tiny", seed=11)


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    for name in ("auto", *KV_8BIT):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    for name in ("int4", "INT8", "uint8"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}': must be one of auto, fp8, int8$"):
            EngineConfig(kv_cache_dtype=name)
    cli = subprocess.run([sys.executable, "-m", "zipage.cli.main", "generate", "--model", "random:llama-tiny",
                          "--device", "cpu", "--kv-cache-dtype", "e5m2", "hi"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert cli.returncode == 2 and "kv_cache_dtype='e5m2': must be one of auto, fp8, int8" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_the_pool_holds_blocks_by_bytes(model_path):
    """The same kv_cache_gb holds about four times the fp32 blocks (twice bf16's): one byte per value
    plus a float32 scale per entry and head, and the pool never exceeds what it was given. fp8 and
    int8 cost the same bytes, so they get the same blocks."""
    engines = {dtype: make_engine(model_path, kv_cache_dtype=dtype, kv_cache_gb=0.002, num_kv_blocks=None)
               for dtype in ("auto", *KV_8BIT)}
    try:
        full = engines["auto"].runner
        assert full.kv_cache.dtype == torch.float32 and full.kv_scales is None and not full.kv_quantized
        assert not full.rotates_qk
        assert engines["auto"].snapshot().memory.kv_dtype == full.kv_dtype_name == "fp32"
        layers, heads, dim, bs = full.num_layers, full.num_kv_heads, full.head_dim, full.block_size
        extra = 12 * heads  # score, position and choice per entry and head under compression
        assert full.block_bytes == layers * bs * (2 * heads * dim * 4 + extra)
        budget = int(0.002 * (1 << 30))
        for name, codes in KV_8BIT.items():
            runner = engines[name].runner
            assert runner.kv_quantized and runner.kv_dtype == runner.kv_cache.dtype == codes
            # int8 keys are stored rotated (a power-of-2 head): every attention layer says so to its store
            assert runner.rotates_qk == (name == "int8")
            assert all(a.qk_rotation == ({"hadamard_qk": True} if name == "int8" else {})
                       for a in runner.model.attention_layers)
            assert runner.kv_scales.shape == runner.kv_cache.shape[:-1] and runner.kv_scales.dtype == torch.float32
            assert runner.block_bytes == layers * bs * (2 * heads * (dim + 4) + extra)
            assert runner.num_blocks / full.num_blocks > 2.0  # head_dim 16 here: the scales cost a fifth
            assert engines[name].snapshot().memory.kv_dtype == runner.kv_dtype_name == name
        assert engines["int8"].runner.num_blocks == engines["fp8"].runner.num_blocks
        for runner in (engine.runner for engine in engines.values()):
            assert runner.kv_bytes <= budget
            assert budget - runner.kv_bytes < runner.block_bytes + runner.query_slot_bytes * runner.num_query_slots
    finally:
        for engine in engines.values():
            engine.close()


@pytest.mark.parametrize("kv_dtype", list(KV_8BIT))
def test_compressed_8bit_outputs_do_not_depend_on_the_batch(model_path, kv_dtype):
    """One request alone and beside three others, each compressed several times: the same tokens,
    the bound and the pool's accounting checked after every step, nothing left held."""
    prompts = random_prompts(4, [20, 37, 9, 60], seed=3)
    engine = make_engine(model_path, kv_cache_dtype=kv_dtype, num_kv_blocks=64)
    try:
        assert engine.runner.kv_cache.dtype == KV_8BIT[kv_dtype]
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


MAX_DRIFT = {"fp8": 0.5, "int8": 0.25}  # nats, the largest log-probability move (measured: 0.38, 0.11)


def test_8bit_prompt_distribution_follows_the_unquantized_cache(smol):
    """SmolLM2 reading real text through an fp8 or an int8 cache ranks the next token as the fp32
    cache does wherever the fp32 cache's choice is clear (e4m3 keeps 3 mantissa bits, int8 a step of
    amax / 127: only near-ties may flip), and its log-probabilities stay close; int8's, on this text,
    closer than fp8's (mean drift about 3x less)."""
    text = ("The river rose through the night, and by morning the low fields were under water. "
            "Farmers moved their animals to the hills, while the village council met in the school "
            "to decide who would guard the bridge. Nobody had seen a flood like it in forty years, "
            "and the old miller said the last one had taken his father's barn and half the orchard.")
    ids = smol.tokenizer.encode(text)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    reference = smol.generate([ids], params)[0].prompt_logprobs[1:]
    mean_drift = {}
    for kv_dtype in KV_8BIT:
        llm = LLM("smollm2-135m", device="cpu", compression=False, num_kv_blocks=64, weight_dtype="float32",
                  kv_cache_dtype=kv_dtype)
        try:
            assert llm.engine.runner.kv_cache.dtype == KV_8BIT[kv_dtype]
            quantized = llm.generate([ids], params)[0].prompt_logprobs[1:]
        finally:
            llm.close()
        clear = 0
        for position, (a, b) in enumerate(zip(reference, quantized)):
            (top, first), (_, second) = a.top.items()
            if first - second > 0.5:  # a lead of more than half a nat
                clear += 1
                assert next(iter(b.top)) == top, f"position {position}: {kv_dtype} chose another token"
        assert clear >= len(reference) // 2
        drifts = [abs(a.logprob - b.logprob) for a, b in zip(reference, quantized)]
        assert 0 < max(drifts) < MAX_DRIFT[kv_dtype], (kv_dtype, max(drifts))  # really quantized, and close
        mean_drift[kv_dtype] = sum(drifts) / len(drifts)
    assert mean_drift["int8"] < mean_drift["fp8"] / 2, mean_drift


def test_the_consoles_kv_gauge_names_the_cache_dtype(model_path):
    from zipage.cli.console.widgets import Gauges

    for dtype, label in (("fp8", "KV fp8"), ("int8", "KV int8"), ("auto", "KV fp32")):
        engine = make_engine(model_path, kv_cache_dtype=dtype)
        try:
            gauges = Gauges()
            gauges.show(engine.snapshot())
            assert gauges.kv.label == label
        finally:
            engine.close()
