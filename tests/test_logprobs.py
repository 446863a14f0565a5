"""Log-probabilities in the engine: each generated and prompt token's logprob, rank and top
alternatives equal a float32 transformers forward on the same weights (the raw distribution), alone
and batched, greedy and sampled, prefilled in chunks, after a prefix-cache hit, preempted and
recomputed, and under compression (where the logits sampling used are the reference); a request of
max_tokens=0 scores its prompt only; the streams carry them; bad values are refused up front."""

from __future__ import annotations

import pytest
import torch

from compression_helpers import assert_drained, build_random_model, make_engine, run
from conftest import random_prompts
from zipage.engine import LLM, EngineThread, SamplingParams
from zipage.engine.execution.model_runner import ModelRunner

TOL = 1e-4  # float32 logprobs of the engine's kernels against transformers'


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared CPU: one thread is fastest and steadiest
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama-tiny"]


@pytest.fixture(scope="module")
def llm(model):
    llm = LLM(model.path, device="cpu", compression=False, block_size=16, num_kv_blocks=128)
    yield llm
    llm.close()


@torch.no_grad()
def reference(hf, ids: list[int]) -> torch.Tensor:
    """Row p: the float32 log-distribution of the token after position p."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_entry(entry, token: int, row: torch.Tensor, k: int) -> None:
    """One TokenLogprobs against the reference row of its position."""
    assert entry.token_id == token
    expected = row[token].item()
    assert entry.logprob == pytest.approx(expected, abs=TOL)
    # Its rank, allowing reference values within the tolerance either way.
    assert int((row > expected + TOL).sum()) + 1 <= entry.rank <= int((row > expected - TOL).sum()) + 1
    assert len(entry.top) == k
    values = list(entry.top.values())
    assert values == sorted(values, reverse=True)
    kth = row.topk(k).values[-1].item() if k else 0.0
    for token_id, logprob in entry.top.items():
        assert logprob == pytest.approx(row[token_id].item(), abs=TOL)
        assert row[token_id].item() >= kth - TOL  # among the k most likely


def check_against(hf, out, params: SamplingParams) -> None:
    """Every logprob the output holds against transformers on its prompt and answer."""
    ids = out.prompt_token_ids + out.token_ids
    rows = reference(hf, ids)
    prompt = len(out.prompt_token_ids)
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == prompt and out.prompt_logprobs[0] is None
        for p in range(1, prompt):
            check_entry(out.prompt_logprobs[p], ids[p], rows[p - 1], params.prompt_logprobs)
    if params.logprobs is None:
        assert out.logprobs is None
    else:
        assert len(out.logprobs) == len(out.token_ids)
        for j, entry in enumerate(out.logprobs):
            check_entry(entry, ids[prompt + j], rows[prompt + j - 1], params.logprobs)


def test_greedy_and_sampled_alone_and_batched_equal_transformers(llm, model):
    prompts = random_prompts(4, [9, 30, 17, 45], seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),  # asks for nothing, beside them
        SamplingParams(temperature=1.2, top_k=30, seed=5, max_tokens=9, ignore_eos=True, logprobs=0,
                       prompt_logprobs=20),
    ]
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    batched = llm.generate(prompts, params)
    for out, again, sp in zip(alone, batched, params):
        check_against(model.hf, out, sp)
        check_against(model.hf, again, sp)
        assert again.token_ids == out.token_ids  # seeded or greedy: the same tokens either way
    assert all(e.rank == 1 for e in alone[0].logprobs)  # greedy picks the most likely token
    # Sampled tokens are scored on the raw distribution, not the filtered one they were drawn from.
    assert any(e.rank > 1 for out in alone[1::2] for e in out.logprobs)


def test_chunked_prefill_and_a_prefix_cache_hit_still_score_the_whole_prompt(model):
    prompt = random_prompts(1, [70], seed=5)[0]
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=4)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model.path, device="cpu", compression=False, block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=16)  # prompts prefill in chunks of at most 16 tokens
    try:
        totals = llm.engine.totals
        llm.generate([prompt], plain)  # its blocks stay in the prefix cache
        hits = totals["prefix_hit_tokens"]
        out = llm.generate([prompt], scored)[0]
        assert totals["prefix_hit_tokens"] == hits  # read again, so that every position is scored
        check_against(model.hf, out, scored)
        llm.generate([prompt], plain)
        assert totals["prefix_hit_tokens"] > hits  # the cache still serves whoever asks no prompt logprobs
    finally:
        llm.close()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, model):
    prompt = random_prompts(1, [33], seed=8)[0]
    params = SamplingParams(max_tokens=0, prompt_logprobs=2, logprobs=2)
    out = llm.generate([prompt], params)[0]
    assert (out.token_ids, out.text, out.finish_reason, out.logprobs) == ([], "", "length", [])
    check_against(model.hf, out, params)
    assert llm.engine.totals["generated_tokens"] >= 0 and not llm.engine.requests
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)  # nothing to return: generating nothing is only for scoring


def test_a_teacher_forced_token_is_scored_as_fed(llm, model):
    prompt = random_prompts(1, [15], seed=10)[0]
    forced = [7, 99, 300, 12]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    seq = llm.engine.add_request(prompt, params, forced_tokens=forced)
    done = []
    while not done:
        done = [out for out in llm.engine.step() if out.finished and out.id == seq.id]
    out = done[0]
    assert out.token_ids == forced == [e.token_id for e in out.logprobs]
    check_against(model.hf, out, params)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs"), (dict(prompt_logprobs="3"), "prompt_logprobs"),
    (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens"),
])
def test_bad_values_are_refused_before_anything_is_queued(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    params = SamplingParams(max_tokens=2)
    for key, value in kwargs.items():
        setattr(params, key, value)
    with pytest.raises(ValueError, match=field):
        llm.generate(["hello"], params)
    assert not llm.engine.requests


def test_preempted_and_recomputed_requests_keep_their_logprobs(model):
    """A pool too small for every request at once preempts some, which prefill again; their logprobs
    are those of an engine with room for all."""
    prompts = random_prompts(4, [40, 52, 36, 47], seed=12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    tight = LLM(model.path, device="cpu", compression=False, block_size=16, num_kv_blocks=14)
    try:
        outs = tight.generate(prompts, params)
        assert tight.engine.totals["preemptions"] > 0
    finally:
        tight.close()
    for out in outs:
        check_against(model.hf, out, params)


@pytest.fixture(scope="module")
def compressing(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("logprobs-compress"), "qwen3-tiny", seed=4)


@pytest.mark.parametrize("overlap", [False, True])
def test_under_compression_they_are_the_logits_sampling_used(compressing, overlap):
    """A prompt over the budget is scored before its compression, so its logprobs are the full
    model's; the answer's are those of the compressed cache each token was sampled from, which the
    logits observer reads. Overlapped steps give the same values."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(compressing, dtype=torch.float32).eval()
    prompts = random_prompts(2, [45, 20], seed=6)  # the first is over the 32-token budget
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=4, prompt_logprobs=4),
              SamplingParams(temperature=0.8, seed=3, max_tokens=50, ignore_eos=True, logprobs=2)]

    def serve(observe: bool):
        engine = make_engine(compressing, overlap_steps=overlap)
        seen: dict[int, list[torch.Tensor]] = {}
        if observe:
            engine.observe_logits(lambda seq, row: seen.setdefault(seq.id, []).append(row.log_softmax(-1)))
        try:
            seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            done = run(engine)
            assert engine.totals["compressions"] >= 3
            assert_drained(engine)
            assert (engine.overlapped_steps > 0) == (overlap and not observe)
            return [done[s.id] for s in seqs], [seen.get(s.id) for s in seqs]
        finally:
            engine.close()

    outs, observed = serve(observe=True)
    for out, rows, sp in zip(outs, observed, params):
        assert len(rows) == len(out.token_ids)
        for entry, token, row in zip(out.logprobs, out.token_ids, rows):
            check_entry(entry, token, row, sp.logprobs)
    first = outs[0]
    rows = reference(hf, first.prompt_token_ids)
    for p in range(1, len(first.prompt_token_ids)):
        check_entry(first.prompt_logprobs[p], first.prompt_token_ids[p], rows[p - 1], 4)
    check_entry(first.logprobs[0], first.token_ids[0], rows[-1], 4)  # sampled before the compression landed
    # The logits observer keeps steps apart; without it, steps overlap and nothing changes.
    again, _ = serve(observe=False)
    for out, other in zip(outs, again):
        assert other.token_ids == out.token_ids
        assert [(e.token_id, e.rank, e.top) for e in other.logprobs] == [(e.token_id, e.rank, e.top) for e in out.logprobs]


def test_two_tensor_parallel_ranks_score_as_one(tiny_models):
    """Every rank computes the prompt rows' logits (the LM head's gather joins them) and rank 0 reduces
    them; a 300-token prompt goes through the LM head in two slices."""
    model = tiny_models["qwen3-tiny"]
    prompt = random_prompts(1, [300], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    outs = []
    for size in (1, 2):
        llm = LLM(model.path, device="cpu", compression=False, block_size=16, num_kv_blocks=64,
                  tensor_parallel_size=size)
        try:
            outs.append(llm.generate([prompt], params)[0])
        finally:
            llm.close()
    one, two = outs
    assert two.token_ids == one.token_ids
    check_against(model.hf, one, params)
    check_against(model.hf, two, params)


def test_requests_that_ask_nothing_cost_no_logprob_work(llm, monkeypatch):
    """A step reduces and copies logprobs only for the rows of requests that asked."""
    steps = []
    launch = ModelRunner.launch

    def spy(self, batch, *rest):
        step = launch(self, batch, *rest)
        steps.append(step)
        return step

    monkeypatch.setattr(ModelRunner, "launch", spy)
    prompts = random_prompts(2, [12, 20], seed=9)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert steps and all(s.logprobs is None and s.prompt is None and not s.logprob_rows for s in steps)
    steps.clear()
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1),
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert all(s.logprobs.shape[0] == len(s.logprob_rows) == 1 for s in steps if s.ids is not None)


def test_streams_carry_each_tokens_logprobs_and_the_prompts_once(model):
    prompt = random_prompts(1, [21], seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    seen = []
    with EngineThread(model.path, device="cpu", compression=False, block_size=16, num_kv_blocks=64) as door:
        handle = door.submit(prompt, params, on_output=seen.append)
        final = handle.result(timeout=120)
    streamed = [e for out in seen if not out.finished for e in out.new_logprobs]
    assert [e.token_id for e in streamed] == final.token_ids[:len(streamed)]
    assert streamed == final.logprobs[:len(streamed)] and len(final.logprobs) == 8
    assert seen[0].prompt_logprobs == final.prompt_logprobs and len(final.prompt_logprobs) == 21
    assert all(out.prompt_logprobs is None for out in seen[1:] if not out.finished)
    check_against(model.hf, final, params)


def test_generate_prints_each_tokens_logprobs_after_the_answer():
    """`zipage generate --logprobs K` (its output not a terminal) prints the answer, then the table."""
    from typer.testing import CliRunner

    from zipage.cli.logprob_table import logprob_table
    from zipage.cli.main import app as cli

    knobs = dict(device="cpu", block_size=16, window=8, num_kv_blocks=64)
    options = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    result = CliRunner().invoke(cli, ["generate", "hello", "--raw", "--temperature", "0", "--max-tokens", "5",
                                      "--logprobs", "2", "--model", "random:llama-tiny", *options])
    assert result.exit_code == 0, result.output
    llm = LLM("random:llama-tiny", **knobs)
    try:
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0]
        table = logprob_table(llm.tokenizer, out.logprobs)
    finally:
        llm.close()
    assert result.stdout.endswith("\n" + table)
    assert table.splitlines()[0].split() == ["#", "token", "logprob", "rank", "most", "likely"]
    assert len(table.splitlines()) == 1 + len(out.token_ids)
    bad = CliRunner().invoke(cli, ["generate", "hello", "--logprobs", "21", "--model", "random:llama-tiny"])
    assert bad.exit_code == 2 and "logprobs=21" in bad.output
