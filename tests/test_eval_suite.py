"""The `zipage eval` suite on a tiny random model: scoring is deterministic, a budget above the context
changes nothing against full KV, full KV's reference is cached and reused, and bad options are refused
with a clear message."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from eval_fixtures import _one_thread, _private_cache  # noqa: F401 (autouse)
from zipage.cli.eval import common as ec
from zipage.cli.eval import fidelity, needle, recall, vartrack
from zipage.cli.main import app
from zipage.engine.config import EngineConfig
from zipage.engine.loading.loader import resolve_model

NEVER = ec.parse_budgets("400%")  # a budget larger than any sample: compression never runs
TINY_RUNS = {
    "needle": lambda path, **kw: needle.run(path, num_samples=1, lengths=[400], depths=[0, 100], **kw),
    "recall": lambda path, **kw: recall.run(path, num_samples=2, tokens=48, **kw),
    "vartrack": lambda path, **kw: vartrack.run(path, num_samples=2, length=400, **kw),
    "fidelity": lambda path, **kw: fidelity.run(path, num_samples=2, tokens=24, **kw),
}


def _cells(results) -> dict:
    """Every row's metrics without timings."""
    return {row["configuration"]: {b: {k: v for k, v in m.items() if k != "seconds"}
                                   for b, m in row["by_budget"].items()} for row in results["rows"]}


@pytest.mark.parametrize("task", sorted(TINY_RUNS))
def test_a_budget_above_the_context_matches_full_kv_and_runs_are_deterministic(task, tiny_path, tmp_path):
    kw = dict(block_size=16, window=4, budgets=NEVER + ec.parse_budgets("1"), configurations=["default"])
    first = TINY_RUNS[task](tiny_path, **kw)
    cells = _cells(first)
    full = cells[ec.FULL_KV]["400%"]
    for name in ("default",):
        never = cells[name]["400%"]
        assert never["compressions"] == 0
        assert {k: v for k, v in never.items() if k != "compressions"} == full
        assert cells[name]["1 blocks"]["compressions"] > 0  # a one-block budget does compress
    if task == "fidelity":
        assert full["score"] == 1.0 and full["mean_kl"] == 0.0 and cells["default"]["400%"]["mean_kl"] == 0.0
        assert cells["default"]["1 blocks"]["mean_kl"] > 0.0
    # The same run again (full KV now from the cache) gives the same numbers.
    assert _cells(TINY_RUNS[task](tiny_path, **kw)) == cells


def test_elastic_budgets_in_a_pool_of_a_given_share(tiny_path):
    """--set pool_share=X sizes each group's pool from what its samples hold in full: with all of it,
    elastic budgets compress nothing and score as full KV; with half, the pool is short and they do."""
    kw = dict(block_size=16, window=4, budgets=ec.parse_budgets("1"), configurations=["default"])
    rich = _cells(TINY_RUNS["recall"](tiny_path, settings={"budget_policy": "elastic", "pool_share": 1}, **kw))
    short = _cells(TINY_RUNS["recall"](tiny_path, settings={"budget_policy": "elastic", "pool_share": 0.5}, **kw))
    full = {k: v for k, v in rich[ec.FULL_KV]["1 blocks"].items() if k != "compressions"}
    assert rich["default"]["1 blocks"]["compressions"] == 0
    assert {k: v for k, v in rich["default"]["1 blocks"].items() if k != "compressions"} == full
    assert short["default"]["1 blocks"]["compressions"] > 0
    requests = [ec.Request(prompt=[1] * 20, free_tokens=13), ec.Request(prompt=[1] * 5, free_tokens=1)]
    assert ec.pool_blocks(requests, 16, 1) == 3 + 1 and ec.pool_blocks(requests, 16, 0.5) == 2


def test_full_kv_is_computed_once_and_reused(tiny_path, tmp_path, monkeypatch):
    kw = dict(block_size=16, window=4, budgets=NEVER, configurations=["default"])
    TINY_RUNS["recall"](tiny_path, **kw)
    cached = list((tmp_path / "cache").glob("recall-*.pt"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    TINY_RUNS["recall"](tiny_path, **kw)
    assert cached[0].stat().st_mtime_ns == stamp
    TINY_RUNS["recall"](tiny_path, split="selection", **kw)  # other samples: another reference
    assert len(list((tmp_path / "cache").glob("recall-*.pt"))) == 2
    # Other default weights (float32, as before quantized CPU weights) key another reference.
    monkeypatch.setattr(EngineConfig, "weight_dtype", "float32")
    TINY_RUNS["recall"](tiny_path, **kw)
    assert len(list((tmp_path / "cache").glob("recall-*.pt"))) == 3
    # So do other forms of a quantized file's CPU weights (float32 copies, as before float16 ones).
    import zipage.engine.execution.models.quantized as quantized

    monkeypatch.setattr(quantized, "half_product_works", lambda: False)
    TINY_RUNS["recall"](tiny_path, **kw)
    assert len(list((tmp_path / "cache").glob("recall-*.pt"))) == 4


def test_partial_results_are_written_as_cells_finish(tiny_path, tmp_path):
    path = tmp_path / "needle.json"
    results = TINY_RUNS["needle"](tiny_path, block_size=16, window=4, budgets=ec.parse_budgets("1,2"),
                                  configurations=["sinks + recent"], json_path=str(path))
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(results))
    assert [r["configuration"] for r in written["rows"]] == [ec.FULL_KV, "sinks + recent"]
    assert set(written["rows"][1]["by_budget"]) == {"1 blocks", "2 blocks"}
    assert {"depth 0%", "depth 100%", "single", "multi", "length 400"} <= set(written["rows"][1]["by_budget"]["1 blocks"])


@pytest.mark.parametrize("budget_blocks", [None, 2])
def test_progress_counts_every_token_and_ends_at_its_total(tiny_path, budget_blocks):
    """The bars count tokens (forced ones too), so they end exactly at their total whatever chunked
    prefill and compressions add in steps."""
    source = resolve_model(tiny_path)
    requests = [ec.Request(list(range(5, 90)), forced=[7, 8, 9], free_tokens=40), ec.Request([3, 4, 5], free_tokens=25)]
    engine = ec.make_engine(source, 16, budget_blocks, 8, {"max_num_batched_tokens": 32}, "cpu")
    counted = []
    try:
        outputs = ec.drive(engine, requests, on_step=counted.append)
        compressions = engine.totals["compressions"]
    finally:
        engine.close()
    assert [len(o) for o in outputs] == [43, 25]
    assert sum(counted) == ec.tokens_of(requests) == 68
    assert (compressions > 0) == (budget_blocks is not None)


def test_exact_match_scoring():
    assert needle.exact_match(" 48213.", "48213")
    assert needle.exact_match("48213 and more", "48213")
    assert not needle.exact_match(" 482134", "48213")  # a longer number is wrong
    assert not needle.exact_match(" 4821", "48213")
    assert not needle.exact_match(" The number is 48213", "48213")


def test_needle_scores_the_answer_exactly():
    """Scoring the right answer gives 100% at every depth; one wrong answer costs exactly its cells."""
    tok = resolve_model("random:llama-tiny").tokenizer
    task, meta = needle.build(tok, "report", 1, [200], [0, 50, 100])
    right = [[tok.encode(" " + s["value"] + ".", add_special_tokens=False) for s in g] for g in meta]
    assert task.score(right, None, None)["score"] == 1.0
    wrong = [list(g) for g in right]
    wrong[0][0] = tok.encode(" 1", add_special_tokens=False)  # the first sample: depth 0, single key
    metrics = task.score(wrong, None, None)
    assert metrics["score"] == pytest.approx(5 / 6)
    assert metrics["depth 0%"] == 0.5 and metrics["depth 50%"] == 1.0 and metrics["single"] == pytest.approx(2 / 3)


def test_needle_prompts_hide_the_key_at_its_depth_among_distractors():
    tok = resolve_model("random:llama-tiny").tokenizer
    for depth in (0, 50, 100):
        s = needle.make_sample(tok, random.Random(depth), 1500, depth, "multi")
        text = tok.decode(s["prompt"])
        body = text[text.index("Memorize"):text.index("What is the special")]
        assert body.count("The special magic number for") == 1 + needle.NUM_DISTRACTORS
        where = body.index(needle.needle(text.rsplit("number for ", 1)[1].split(" ")[0], s["value"])) / len(body)
        assert abs(where - depth / 100) < 0.2
        assert abs(len(s["prompt"]) - 1500) < 100


def test_filler_is_varied_and_seeded():
    from zipage.cli.eval.filler import filler_sentences

    text = filler_sentences(random.Random(0), 200)
    assert len(set(text)) > 150
    assert filler_sentences(random.Random(0), 200) == text


def test_splits_are_seeded_and_disjoint():
    selection, report = ec.split_indices(16, "selection"), ec.split_indices(16, "report")
    assert not set(selection) & set(report) and sorted(selection + report) == list(range(16))
    assert selection == ec.split_indices(16, "selection")
    tok = resolve_model("random:llama-tiny").tokenizer
    a = [recall.make_sample(tok, ec.sample_rng("recall", "selection", i), 32)["prompt"] for i in range(8)]
    b = [recall.make_sample(tok, ec.sample_rng("recall", "report", i), 32)["prompt"] for i in range(8)]
    assert not set(map(tuple, a)) & set(map(tuple, b))


def test_budget_parsing():
    assert ec.parse_budgets("25%,8") == [ec.Budget(share=0.25), ec.Budget(blocks=8)]
    assert ec.Budget(share=0.5).blocks_for(1000, 32) == 16 and ec.Budget(share=0.01).blocks_for(100, 32) == 1
    assert ec.Budget(share=0.5).label == "50%" and ec.Budget(blocks=8).label == "8 blocks"


@pytest.mark.parametrize("call, message", [
    (lambda: ec.parse_budgets("0"), "neither a block count"),
    (lambda: ec.parse_budgets("half"), "neither a block count"),
    (lambda: ec.parse_budgets("8,8"), "listed twice"),
    (lambda: ec.parse_configurations("default;bogus"), "unknown configuration 'bogus'"),
    (lambda: ec.parse_settings(["recent_share"]), "expected KNOB=VALUE"),
    (lambda: ec.parse_settings(["bogus=1"]), "unknown engine knob 'bogus'"),
    (lambda: ec.parse_settings(["recent_share=2"]), "recent_share=2"),
    (lambda: ec.parse_settings(["prompt_share=1"]), "prompt_share=1"),
    (lambda: ec.parse_settings(["pool_share=0"]), "pool_share=0"),
    (lambda: ec.parse_settings(["pool_share=true"]), "pool_share=True"),
    (lambda: ec.split_indices(16, "train"), "split 'train'"),
    (lambda: needle.run("random:llama-tiny", depths=[101]), "--depth 101"),
    (lambda: recall.run("random:llama-tiny", num_samples=0), "--num-samples 0"),
    (lambda: fidelity.run("random:llama-tiny", num_samples=9), "--num-samples 9"),
    (lambda: vartrack.run("random:llama-tiny", hops=0), "--hops 0"),
])
def test_bad_options_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_command_line_reports_bad_options_with_status_2():
    runner = CliRunner()
    for args, message in [(["--budgets", "25%,x"], "neither a block count"),
                          (["--configurations", "nope"], "unknown configuration"),
                          (["--set", "window=0"], "window=0"), (["--depths", "a"], "expected integers")]:
        result = runner.invoke(app, ["eval", "needle", "--model", "random:llama-tiny", *args])
        assert result.exit_code == 2, result.output
        assert message in result.output


def test_the_leaderboard_joins_tasks_by_configuration(tiny_path, tmp_path):
    kw = dict(block_size=16, window=4, budgets=ec.parse_budgets("1"))
    recall_results = TINY_RUNS["recall"](tiny_path, configurations=["random"], **kw)
    fidelity_results = TINY_RUNS["fidelity"](tiny_path, configurations=["default"], **kw)
    lines = ec.leaderboard([recall_results, fidelity_results]).splitlines()
    assert lines[0] == "| configuration | recall 1 blocks | fidelity 1 blocks |"
    assert lines[2] == "| full KV | 0.0% | 100.0% / 0.0000 |"  # a random tiny model recalls nothing
    assert lines[3].startswith("| random | 0.0% |  |") and lines[4].startswith("| default |  | ")
    # A second run of the same task adds its rows to the same columns; full KV appears once.
    again = {**recall_results, "rows": [recall_results["rows"][0], {**recall_results["rows"][1], "configuration": "x"}]}
    merged = ec.leaderboard([recall_results, again]).splitlines()
    assert [line.split(" | ")[0] for line in merged[2:]] == ["| full KV", "| random", "| x"]
    path = tmp_path / "r.json"
    ec.write_json(str(path), recall_results)
    result = CliRunner().invoke(app, ["eval", "leaderboard", str(path)])
    assert result.exit_code == 0 and "| random | 0.0% |" in result.output


def test_quick_narrows_only_what_is_left_at_its_default(tiny_path, monkeypatch):
    """--quick: one budget, the default row against full KV and the task's smallest sample; an option
    given explicitly still counts. The task runs for real on the tiny model."""
    seen, real_run = {}, fidelity.run

    def run(**kwargs):
        seen.update(kwargs)
        return real_run(**kwargs)

    monkeypatch.setattr(fidelity, "run", run)
    result = CliRunner().invoke(app, ["eval", "fidelity", "--quick", "--model", tiny_path, "--num-samples", "2"])
    assert result.exit_code == 0, result.output
    assert seen["budgets"] == ec.parse_budgets("50%") and seen["configurations"] == ["default"]
    assert seen["num_samples"] == 2 and seen["tokens"] == 96  # given explicitly / --quick's
    assert "| default |" in result.output and "| full KV |" in result.output
