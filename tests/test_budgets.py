"""Budgets that fit each request: a request's own kv_budget, and elastic budgets that compress only
when the pool is short (docs/design-notes.md, "Budgets"). Every engine here steps through
`run`, which checks the pool invariants and each request's bound after every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from compression_helpers import SMALL_BUDGET, assert_drained, build_random_model, greedy, make_engine, random_prompts, run
from zipage.engine import SamplingParams

torch.set_num_threads(1)
BS = 16  # compression_helpers.SMALL_BUDGET: block size 16, window 4, engine budget 2 blocks


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-budgets"), "qwen3-tiny", seed=11)


def serve(path, prompts, params, **knobs):
    """Outputs (in submission order), totals, and the most blocks each request held after its first
    compression (by submission index); invariants after every step, a drained pool at the end."""
    engine = make_engine(path, **knobs)
    try:
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        peak_compressed = [0] * len(seqs)
        index = {s.id: i for i, s in enumerate(seqs)}

        def watch(e):
            for info in e.snapshot(max_events=0).requests:
                if info.times_compressed:
                    i = index[info.id]
                    peak_compressed[i] = max(peak_compressed[i], len(info.block_table))

        done = run(engine, on_step=watch)
        assert_drained(engine)
        return [done[s.id] for s in seqs], dict(engine.totals), peak_compressed, list(engine.events)
    finally:
        engine.close()


# -- per-request budgets ------------------------------------------------------------------

def test_each_request_is_held_to_its_own_budget(model_path):
    budgets = [1, 2, 4, None, 3, 1]
    prompts = random_prompts(len(budgets), [5, 12, 20, 9, 30, 3], seed=1)
    params = [greedy(150, kv_budget=b) for b in budgets]
    outs, totals, peaks, events = serve(model_path, prompts, params, num_kv_blocks=96)
    assert totals["preemptions"] == 0 and totals["compressions"] > len(budgets)
    for budget, peak in zip(budgets, peaks):
        n = budget or 2  # the engine's max_cache_blocks_per_seq
        assert 0 < peak <= n + 1, (budget, peak)
    # Every compression kept exactly its own request's budget.
    by_request = {o.id: (b or 2) for o, b in zip(outs, budgets)}
    compressed = [e for e in events if e.kind == "compressed"]
    assert compressed and all(e.tokens_after == by_request[e.request] * BS for e in compressed)
    assert all(e.budget_blocks == by_request[e.request] and e.reason == "budget" for e in compressed)


def test_mixed_budgets_batch_together_without_changing_any_output(model_path):
    """A request's greedy output depends on its own budget only: batched with others of different
    budgets, it is what it is alone."""
    budgets = [1, 3, None, 2]
    prompts = random_prompts(len(budgets), [7, 25, 14, 40], seed=2)
    params = [greedy(90, kv_budget=b) for b in budgets]
    together, _, _, _ = serve(model_path, prompts, params, num_kv_blocks=64)
    for prompt, sp, out in zip(prompts, params, together):
        alone, _, _, _ = serve(model_path, [prompt], [sp], num_kv_blocks=64)
        assert out.token_ids == alone[0].token_ids
    # And the budget matters: the default budget differs from a budget of 1 on the same prompt.
    one, _, _, _ = serve(model_path, prompts[:1], [greedy(90, kv_budget=1)], num_kv_blocks=64)
    default, _, _, _ = serve(model_path, prompts[:1], [greedy(90)], num_kv_blocks=64)
    assert one[0].metrics["times_compressed"] > default[0].metrics["times_compressed"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4", 4.0])
def test_bad_budget_values_are_refused_by_sampling_params(bad):
    with pytest.raises(ValueError, match="kv_budget"):
        SamplingParams(kv_budget=bad)


def test_budgets_the_engine_cannot_hold_are_refused_and_leave_nothing_behind(model_path):
    engine = make_engine(model_path, num_kv_blocks=10)
    try:
        engine.add_request([1, 2, 3], greedy(4, kv_budget=9))  # 10 blocks: fits exactly
        with pytest.raises(ValueError, match="kv_budget=10: .*pool has 10"):
            engine.add_request([1, 2, 3], greedy(4, kv_budget=10))
        run(engine)
        assert_drained(engine)
        assert engine.totals["finished"] == 1
    finally:
        engine.close()
    full = make_engine(model_path, compression=False, num_kv_blocks=10)
    try:
        with pytest.raises(ValueError, match="compression is off"):
            full.add_request([1, 2, 3], greedy(4, kv_budget=2))
        assert not full.requests and not full.scheduler.has_work()
    finally:
        full.close()
    sinks = make_engine(model_path, num_kv_blocks=10, num_sink_tokens=6)
    try:  # 6 sinks + the newest 12 kept (0.75 of 16) do not fit a 1-block budget (they fit the engine's 2)
        with pytest.raises(ValueError, match="kv_budget=1: sinks plus the newest"):
            sinks.add_request([1, 2, 3], greedy(4, kv_budget=1))
    finally:
        sinks.close()


# -- elastic budgets ------------------------------------------------------------------------

def test_elastic_is_full_kv_while_the_pool_has_room(model_path):
    prompts = random_prompts(5, [6, 40, 17, 70, 3], seed=3)
    params = [greedy(m, kv_budget=b) for m, b in zip([120, 80, 150, 60, 100], [1, None, 2, 1, 3])]
    elastic, totals, _, _ = serve(model_path, prompts, params, num_kv_blocks=200, budget_policy="elastic")
    full, _, _, _ = serve(model_path, prompts, [greedy(p.max_tokens) for p in params], num_kv_blocks=200,
                          compression=False)
    assert [o.token_ids for o in elastic] == [o.token_ids for o in full]
    assert totals["compressions"] == 0 and totals["preemptions"] == 0
    # The same requests under fixed budgets are compressed (so the comparison is not vacuous).
    fixed, fixed_totals, _, _ = serve(model_path, prompts, params, num_kv_blocks=200)
    assert fixed_totals["compressions"] > 0 and [o.token_ids for o in fixed] != [o.token_ids for o in full]


@pytest.mark.parametrize("async_compress", [False, True])
def test_elastic_compresses_instead_of_preempting_when_the_pool_is_short(model_path, async_compress):
    # Eight requests that would each grow to 9 blocks, in a pool of 24: full KV would preempt.
    prompts = random_prompts(8, [10, 4, 22, 15], seed=4)
    params = [greedy(130) for _ in prompts]
    _, full_totals, _, _ = serve(model_path, prompts, params, num_kv_blocks=24, compression=False)
    assert full_totals["preemptions"] > 0
    outs, totals, _, events = serve(model_path, prompts, params, num_kv_blocks=24, budget_policy="elastic",
                                    async_compress=async_compress)
    assert totals["preemptions"] == 0
    assert totals["pool_compressions"] == totals["compressions"] > 0
    assert all(o.num_output_tokens == 130 for o in outs)
    pool = [e for e in events if e.kind == "compressed"]
    assert all(e.reason == "pool" and e.tokens_after == 2 * BS for e in pool)
    # Largest first: some compressions start from well above the floor, not only at its trigger.
    assert max(e.blocks_before for e in pool) > 3


def test_elastic_floors_follow_each_requests_budget(model_path):
    prompts = random_prompts(6, [8, 30], seed=5)
    budgets = [1, 3, 2, 1, 3, 2]
    outs, totals, _, events = serve(model_path, prompts, [greedy(140, kv_budget=b) for b in budgets],
                                    num_kv_blocks=28, budget_policy="elastic")
    assert totals["preemptions"] == 0 and totals["pool_compressions"] > 0
    floor = {o.id: b for o, b in zip(outs, budgets)}
    assert all(e.tokens_after == floor[e.request] * BS for e in events if e.kind == "compressed")


@settings(max_examples=15, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6), pool=st.integers(8, 40),
       chunk=st.sampled_from([8, 16, 33, 4096]), max_tokens=st.integers(1, 120),
       budgets=st.lists(st.sampled_from([None, 1, 2, 3]), min_size=6, max_size=6),
       overlap=st.booleans(), shared_prefix=st.booleans(), seed=st.integers(0, 10_000))
def test_elastic_invariants_hold_under_any_schedule(model_path, lengths, pool, chunk, max_tokens, budgets, overlap,
                                                    shared_prefix, seed):
    """Chunked prefill, prefix caching (a shared head), preemption of requests that cannot be
    compressed, overlapped steps and mixed floors: every step keeps the pool exact, every request
    ends with all its tokens, and nothing is left behind."""
    prompts = random_prompts(len(lengths), lengths, seed=seed)
    if shared_prefix:
        head = random_prompts(1, [40], seed=seed + 1)[0]
        prompts = [head + p for p in prompts]
    pool = max(pool, max(-(-len(p) // BS) + 1 for p in prompts))
    params = [greedy(max_tokens, kv_budget=budgets[i]) for i in range(len(prompts))]
    outs, _, _, _ = serve(model_path, prompts, params, num_kv_blocks=pool, max_num_batched_tokens=chunk,
                          budget_policy="elastic", overlap_steps=overlap)
    for out in outs:
        assert out.finish_reason == "length"
        assert out.num_output_tokens == max_tokens or out.error is not None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_lone_request_compresses_itself_when_it_fills_the_pool(model_path, overlap):
    """One request and a pool of 5 blocks: with nothing else to compress, it is compressed down to its
    floor each time it fills the pool (at 80 entries, keeping 32: after 60, 108 and 156 tokens), in an
    overlapped step too (where nothing then decodes)."""
    prompt = random_prompts(1, [20], seed=6)
    outs, totals, _, events = serve(model_path, prompt, [greedy(200)], num_kv_blocks=5, budget_policy="elastic",
                                    overlap_steps=overlap)
    assert outs[0].num_output_tokens == 200 and totals["preemptions"] == 0
    pool = [e for e in events if e.kind == "compressed"]
    assert len(pool) == 3 and all(e.reason == "pool" and e.blocks_before == 5 and e.blocks_after == 3 for e in pool)


def test_a_waiting_prompt_is_admitted_by_compressing_the_running_one(model_path):
    """Overlapped steps: the running request decodes with room to spare, but the prompt waiting behind
    it does not fit; the running request is compressed to its floor (no one decodes that step), and
    the waiting one is admitted without a preemption."""
    engine = make_engine(model_path, num_kv_blocks=6, budget_policy="elastic", overlap_steps=True)
    try:
        first = engine.add_request(random_prompts(1, [20], seed=7)[0], greedy(100))
        while first.kv_len < 50:
            engine.step()
            engine.check_invariants()
        second = engine.add_request(random_prompts(1, [40], seed=8)[0], greedy(30))
        done = run(engine)
        assert_drained(engine)
        assert done[first.id].num_output_tokens == 100 and done[second.id].num_output_tokens == 30
        assert engine.totals["preemptions"] == 0
        compressed = [e for e in engine.events if e.kind == "compressed"]
        assert compressed[0].request == first.id and compressed[0].reason == "pool"
        assert compressed[0].blocks_before == 4 and compressed[0].blocks_after == 3
    finally:
        engine.close()


def test_generate_checks_every_budget_before_it_runs_anything(model_path):
    from zipage.engine import LLM

    llm = LLM(model_path, **SMALL_BUDGET, num_kv_blocks=10)
    try:
        params = [greedy(4), greedy(4, kv_budget=2), greedy(4, kv_budget=10)]
        with pytest.raises(ValueError, match="kv_budget=10"):
            llm.generate([[1, 2, 3]] * 3, params)
        assert llm.engine.num_added == 0 and not llm.engine.scheduler.has_work()
        assert [len(o.token_ids) for o in llm.generate([[1, 2, 3]] * 2, params[:2])] == [4, 4]
    finally:
        llm.close()


def test_elastic_in_a_pool_that_holds_every_request_exactly_compresses_nothing(model_path):
    """The pool holds each request's full length and not a block more: looking ahead for blocks must
    not count the steps a request never takes (it stops at max_tokens), or it compresses for nothing."""
    prompts = random_prompts(4, [10], seed=9)
    outputs = [54] * 4  # each request 64 tokens long (two blocks of 32), all ending in the same step
    pool = sum(-(-(len(p) + n) // 32) for p, n in zip(prompts, outputs))
    elastic, totals, _, _ = serve(model_path, prompts, [greedy(n, kv_budget=1) for n in outputs], num_kv_blocks=pool,
                                  budget_policy="elastic", block_size=32, num_query_slots=4)
    full, _, _, _ = serve(model_path, prompts, [greedy(n) for n in outputs], num_kv_blocks=pool, compression=False,
                          block_size=32)
    assert totals["compressions"] == 0 and totals["preemptions"] == 0
    assert [o.token_ids for o in elastic] == [o.token_ids for o in full]
