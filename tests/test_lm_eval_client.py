"""lm-evaluation-harness, a real evaluation client, against `zipage serve` with its `local-completions`
model: a multiple-choice task scored by log-likelihood (echo, logprobs, max_tokens 1) and a
generate_until task, both shipped in tests/lm_eval_tasks (no download). Its log-likelihoods are the
engine's own prompt logprobs, and its generations the engine's greedy answers.

Needs the eval-client extra, which the clients extra includes (pip install -e ".[test,clients]", as CI does)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_helpers import API_KEY, start_server, stop_server
from zipage.engine import LLM, SamplingParams
from zipage.testing import save_random_model

lm_eval = pytest.importorskip("lm_eval", reason='the clients extra: pip install -e ".[test,clients]"')

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "lm_eval_tasks"  # their data_files are paths from the repository's root
TOL = 1e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny random model folder: the server's weights and lm-eval's tokenizer."""
    folder = tmp_path_factory.mktemp("lm-eval-model")
    save_random_model(folder, "llama-tiny", seed=3)
    return str(folder)


@pytest.fixture(scope="module")
def results(model, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("lm-eval-serve") / "server.log", model=model)
    patch = pytest.MonkeyPatch()
    try:
        patch.chdir(ROOT)
        patch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer token
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            patch.setenv(name, "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("lm-eval-datasets")))
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.tasks import TaskManager

        lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=model, tokenizer=model,
                                 tokenizer_backend="huggingface", tokenized_requests=True, max_retries=1)
        yield lm_eval.simple_evaluate(model=lm, tasks=["zipage_choice", "zipage_until"],
                                      task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
                                      bootstrap_iters=0)
    finally:
        patch.undo()
        stop_server(server)


@pytest.fixture(scope="module")
def offline(model):
    """The server's engine in this process: same folder and knobs, float32 on the CPU."""
    llm = LLM(model, device="cpu", dtype="float32", block_size=16, window=8, max_cache_blocks_per_seq=2,
              num_kv_blocks=64)  # serve_helpers.KNOBS
    yield llm
    llm.close()


def test_log_likelihoods_are_the_engines_prompt_logprobs(results, offline):
    samples = results["samples"]["zipage_choice"]
    assert len(samples) == 4 and "acc,none" in results["results"]["zipage_choice"]
    encode = offline.tokenizer.encode
    for sample in samples:
        for (context, continuation), [(loglikelihood, greedy)] in zip(sample["arguments"], sample["resps"]):
            context_ids = encode(context, add_special_tokens=False)
            ids = encode(context + continuation, add_special_tokens=False)
            out = offline.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
            scored = out.prompt_logprobs[len(context_ids):]
            assert loglikelihood == pytest.approx(sum(e.logprob for e in scored), abs=TOL)
            assert greedy == all(e.rank == 1 for e in scored)


def test_generations_are_the_engines_greedy_answers(results, offline):
    samples = results["samples"]["zipage_until"]
    assert len(samples) == 3 and "exact_match,none" in results["results"]["zipage_until"]
    eos = offline.tokenizer.eos_token
    for sample in samples:
        [(context, kwargs)] = sample["arguments"]
        ids = offline.tokenizer.encode(context, add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=kwargs["max_gen_toks"], stop=kwargs["until"] + [eos])
        assert sample["resps"] == [[offline.generate([ids], params)[0].text]]
