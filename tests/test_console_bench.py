"""`run_bench`: the modes on one tiny model, and the transformers model holding exactly the
engine's weights."""

from __future__ import annotations

import json

import pytest
import torch

from zipage.engine import LLM
from zipage.engine.config import EngineConfig
from zipage.cli.bench import hf_model, run_bench

KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=1, num_kv_blocks=32)


@pytest.mark.parametrize("preset", ["random:llama-tiny", "random:qwen3-tiny"])
def test_hf_model_has_the_engine_weights(preset):
    llm = LLM(preset, **KNOBS)
    ours = dict(llm.engine.runner.model.state_dict())
    llm.engine.close()
    theirs = hf_model(EngineConfig.from_kwargs(preset, **KNOBS)).state_dict()
    for name, tensor in ours.items():
        if ".qkv_proj." in name:
            parts = [theirs[name.replace(".qkv_proj.", f".{p}.")] for p in ("q_proj", "k_proj", "v_proj")]
            expected = torch.cat(parts)
        elif ".gate_up_proj." in name:
            expected = torch.cat([theirs[name.replace(".gate_up_proj.", f".{p}.")] for p in ("gate_proj", "up_proj")])
        else:
            expected = theirs[name]
        assert torch.equal(tensor, expected), name


def test_run_bench_reports_every_mode():
    seen, notes = [], []
    results = run_bench("random:llama-tiny", ["fullkv", "zipage"], num_requests=3, input_len=10, output_len=40,
                        engine_kwargs=KNOBS, progress=lambda mode, done, total: seen.append((mode, done, total)),
                        repeats=2, note=notes.append)
    fullkv, zipage = results["results"]
    assert (fullkv["mode"], zipage["mode"]) == ("fullkv", "zipage")
    assert fullkv["output_tokens"] == zipage["output_tokens"] == 120
    assert len(fullkv["runs_tokens_per_s"]) == len(zipage["runs_tokens_per_s"]) == 2
    for r in (fullkv, zipage):
        low, high = r["spread"]
        assert low <= r["tokens_per_s"] <= high and (low, high) == (min(r["runs_tokens_per_s"]),
                                                                    max(r["runs_tokens_per_s"]))
    assert fullkv["ratio"] == 1.0 and zipage["ratio"] == pytest.approx(zipage["tokens_per_s"] / fullkv["tokens_per_s"])
    overlap = zipage["spread"][0] <= fullkv["spread"][1] and fullkv["spread"][0] <= zipage["spread"][1]
    assert zipage["within_noise"] == overlap and not fullkv["within_noise"]
    # The bars count generated tokens, step by step: 2 runs x 3 requests x 40 tokens per mode.
    zipage_progress = [done for mode, done, total in seen if mode == "zipage"]
    assert {total for _, _, total in seen} == {240} and zipage_progress[-1] == 240
    assert zipage_progress == sorted(zipage_progress) and len(set(zipage_progress)) > 40
    # 10 + 40 tokens in blocks of 16 against a 1-block budget: at most 2 blocks under Zipage, up to 4 under full KV
    footprint = results["kv_footprint"]
    assert 1.0 < footprint["zipage_blocks"] <= 2.0 < footprint["full_kv_blocks"] <= 4.0
    assert footprint["ratio"] == pytest.approx(footprint["full_kv_blocks"] / footprint["zipage_blocks"])
    assert results["compression_can_trigger"] and notes == []


def test_run_bench_says_when_compression_cannot_trigger():
    notes = []
    results = run_bench("random:llama-tiny", ["zipage", "fullkv"], num_requests=2, input_len=10, output_len=6,
                        engine_kwargs=KNOBS, repeats=1, note=notes.append)
    assert not results["compression_can_trigger"] and results["kv_footprint"]["ratio"] == 1.0
    assert len(notes) == 1 and "compression cannot trigger: 10 + 6 tokens fit in the 2 blocks of 16" in notes[0]


def test_run_bench_elastic_mode_compresses_only_for_the_pool():
    """Mode elastic is Zipage with elastic budgets beside the engine's own (fixed) policy: 3 requests of
    10 + 40 tokens need 4 blocks each in full, 12 in all, against a pool of 8."""
    notes = []
    results = run_bench("random:llama-tiny", ["zipage", "elastic", "fullkv"], num_requests=3, input_len=10,
                        output_len=40, engine_kwargs=dict(KNOBS, num_kv_blocks=8), repeats=1, note=notes.append)
    zipage, elastic, fullkv = results["results"]
    assert [r["mode"] for r in results["results"]] == ["zipage", "elastic", "fullkv"]
    assert [r["budget_policy"] for r in results["results"]] == ["fixed", "elastic", None]
    assert zipage["output_tokens"] == elastic["output_tokens"] == fullkv["output_tokens"] == 120
    assert zipage["compressions"] > 0 and zipage["pool_compressions"] == 0
    assert elastic["compressions"] == elastic["pool_compressions"] > 0
    assert fullkv["compressions"] == 0 and fullkv["preemptions"] > 0
    assert results["elastic_can_trigger"] and notes == []


def test_run_bench_says_when_the_pool_holds_every_request_in_full():
    notes = []
    results = run_bench("random:llama-tiny", ["elastic", "fullkv"], num_requests=3, input_len=10, output_len=40,
                        engine_kwargs=KNOBS, repeats=1, note=notes.append)
    elastic = results["results"][0]
    assert results["compression_can_trigger"] and not results["elastic_can_trigger"]
    assert elastic["compressions"] == 0 and elastic["output_tokens"] == 120
    assert len(notes) == 1 and notes[0].startswith("elastic compression cannot trigger:")
    assert "the full KV of 3 requests at once (12 blocks) fits in the pool of 32" in notes[0]


def test_bench_command_runs_mode_elastic(tmp_path):
    from typer.testing import CliRunner

    from zipage.cli.main import app

    out = tmp_path / "bench.json"
    argv = ["bench", "--mode", "elastic", "--mode", "fullkv", "--model", "random:llama-tiny", "--device", "cpu",
            "--block-size", "16", "--window", "8", "--max-cache-blocks-per-seq", "1", "--num-kv-blocks", "8",
            "--num-requests", "3", "--input-len", "10", "--output-len", "40", "--repeats", "1", "--json", str(out)]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    elastic, fullkv = json.loads(out.read_text())["results"]
    assert (elastic["mode"], elastic["budget_policy"], fullkv["mode"]) == ("elastic", "elastic", "fullkv")
    assert elastic["pool_compressions"] > 0
    assert "vs elastic" in result.output  # the table's ratio column is against the first mode


def test_run_bench_rejects_bad_settings():
    with pytest.raises(ValueError, match="unknown mode 'vllm'"):
        run_bench("random:llama-tiny", ["vllm"], 1, 1, 1)
    with pytest.raises(ValueError, match="output_len=0"):
        run_bench("random:llama-tiny", ["zipage"], 1, 1, 0)
    with pytest.raises(ValueError, match="block_size"):
        run_bench("random:llama-tiny", ["zipage"], 1, 1, 1, {"block_size": 3})
    with pytest.raises(ValueError, match="repeats=0"):
        run_bench("random:llama-tiny", ["zipage"], 1, 1, 1, repeats=0)


@pytest.mark.parametrize("compression", [False, True])
def test_kv_footprint_is_what_the_engine_holds(compression):
    """The footprint model behind the throughput ceiling, checked against the blocks the engine
    really holds after every decode step (prompts below, inside and above the budget)."""
    from zipage.engine.core.engine_core import EngineCore
    from zipage.engine.config import SamplingParams
    from zipage.engine.loading.loader import resolve_model
    from zipage.cli.bench import kv_footprint

    prompt_lens, output_lens = [5, 40, 70], [90, 61, 33]
    engine = EngineCore(EngineConfig(model="random:llama-tiny", device="cpu", block_size=16, window=8,
                                     max_cache_blocks_per_seq=3, num_kv_blocks=64, compression=compression,
                                     async_compress=False), source=resolve_model("random:llama-tiny"))
    for p, n in zip(prompt_lens, output_lens):
        engine.add_request(list(range(3, 3 + p)), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    held = []
    launch = engine.runner.launch

    def launch_and_count(batch, *rest):  # a decode batch's tables already hold the block for the new token
        if not batch.is_prefill:
            held.extend(len(seq.block_table) for seq in batch.seqs)
        return launch(batch, *rest)

    engine.runner.launch = launch_and_count
    while engine.has_work():
        engine.step()
    engine.close()
    expected = kv_footprint(prompt_lens, output_lens, block_size=16, budget_blocks=3)
    key = "zipage_blocks" if compression else "full_kv_blocks"
    assert len(held) == sum(output_lens) - len(output_lens)
    assert sum(held) / len(held) == pytest.approx(expected[key])
    if compression:
        assert max(held) == 4 and expected["ratio"] > 1.2
