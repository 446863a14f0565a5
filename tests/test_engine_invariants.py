"""Pool accounting under random workloads: arrivals, prompt lengths, max_tokens, aborts and
tiny pools, driving EngineCore step by step and checking invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BASE_KNOBS, assert_pool_empty, greedy, random_prompts
from zipage.engine import EngineConfig
from zipage.engine.core.engine_core import EngineCore

BLOCK = 16
MAX_TOKENS = 24
# (pool blocks, prefix caching, prefill token budget): tiny pools force preemption, small
# budgets force chunked prefill.
ENGINE_SHAPES = [(4, True, 4096), (7, False, 24), (12, True, 40)]
BASES = random_prompts(3, [70, 70, 70], seed=99)  # prompts share prefixes of these


def make_core(path: str, blocks: int, prefix_caching: bool = True, budget: int = 4096, **kw) -> EngineCore:
    config = EngineConfig(model=path, block_size=BLOCK, num_kv_blocks=blocks, prefix_caching=prefix_caching,
                          max_num_batched_tokens=budget, **BASE_KNOBS, **kw)
    return EngineCore(config)


@pytest.fixture(scope="module")
def cores(tiny_path):
    return {shape: make_core(tiny_path, *shape) for shape in ENGINE_SHAPES}


@pytest.fixture(scope="module")
def reference(tiny_path):
    """Greedy tokens of a prompt run alone in a big pool, without prefix caching (memoised)."""
    core = make_core(tiny_path, 64, prefix_caching=False)
    memo: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            core.add_request(prompt, greedy(MAX_TOKENS, ignore_eos=True))
            outs = []
            while core.has_work():
                outs += [o for o in core.step() if o.finished]
            memo[key] = outs[0].token_ids
        return memo[key]

    return tokens


request_st = st.fixed_dictionaries({
    "base": st.integers(0, len(BASES) - 1),
    "shared": st.integers(0, 70),  # tokens taken from the shared base
    "own": st.integers(0, 40),  # private tail
    "max_tokens": st.integers(1, MAX_TOKENS),
    "arrival": st.integers(0, 12),
    "abort_at": st.one_of(st.none(), st.integers(0, 40)),
})


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from(ENGINE_SHAPES), requests=st.lists(request_st, min_size=1, max_size=10),
       seed=st.integers(0, 10_000))
def test_random_workloads_free_every_block(cores, reference, shape, requests, seed):
    engine: EngineCore = cores[shape]
    capacity = shape[0] * BLOCK
    assert_pool_empty(engine)
    tails = random_prompts(len(requests), [40], seed=seed)
    plan = []
    for i, r in enumerate(requests):
        prompt = BASES[r["base"]][:r["shared"]] + tails[i][:r["own"]]
        if not prompt:
            prompt = [1 + i]
        # Keep each request within the pool even at full length (see test_request_outgrowing_...).
        max_tokens = max(1, min(r["max_tokens"], capacity - len(prompt)))
        plan.append((r["arrival"], prompt, max_tokens, r["abort_at"]))

    live: dict[int, tuple] = {}
    results: dict[int, object] = {}
    step = 0
    try:
        while step <= 12 or engine.has_work():
            for arrival, prompt, max_tokens, abort_at in plan:
                if arrival != step:
                    continue
                if -(-(len(prompt) + 1) // BLOCK) > shape[0]:
                    with pytest.raises(ValueError, match="KV pool"):
                        engine.add_request(prompt, greedy(max_tokens, ignore_eos=True))
                    continue
                seq = engine.add_request(prompt, greedy(max_tokens, ignore_eos=True))
                live[seq.id] = (prompt, max_tokens, None if abort_at is None else step + abort_at)
            for request_id, (_, _, abort_step) in live.items():
                if abort_step == step and request_id not in results:
                    out = engine.abort(request_id)
                    assert out is not None and out.finish_reason == "abort"
                    results[request_id] = out
                    engine.check_invariants()
                    assert request_id not in engine.requests
            for out in engine.step():
                if out.finished:
                    assert out.id not in results, "a request finished twice"
                    results[out.id] = out
            engine.check_invariants()
            pool = engine.snapshot().pool
            assert pool.free + pool.used == pool.total
            step += 1
            assert step < 2000, "the engine stopped making progress"
    finally:
        for request_id in list(engine.requests):
            engine.abort(request_id)

    assert sorted(results) == sorted(live)
    for request_id, (prompt, max_tokens, _) in live.items():
        out = results[request_id]
        want = reference(prompt)[:max_tokens]
        if out.finish_reason == "abort":
            assert out.token_ids == want[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length"
            assert out.token_ids == want
    assert_pool_empty(engine)
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_abort_frees_blocks_at_once_in_every_state(tiny_path):
    """Abort a request that is waiting, mid chunked prefill, decoding, and preempted."""
    core = make_core(tiny_path, 8, budget=16)
    params = greedy(200, ignore_eos=True)
    a = core.add_request(random_prompts(1, [40], seed=1)[0], params)
    b = core.add_request(random_prompts(1, [30], seed=2)[0], params)
    # Waiting (not admitted yet): nothing held, aborting frees nothing and leaves nothing.
    out = core.abort(b.id)
    assert out.finish_reason == "abort" and out.token_ids == []
    core.check_invariants()
    assert [e.kind for e in core.events][-1] == "aborted"
    # Mid chunked prefill (40 tokens at 16 per step).
    core.step()
    assert a.block_table and a.num_computed_tokens == 16
    core.abort(a.id)
    core.check_invariants()
    assert core.snapshot().pool.free == 8
    # Decoding.
    c = core.add_request([5, 6, 7], params)
    for _ in range(5):
        core.step()
    assert c.num_output_tokens >= 4 and c.block_table
    out = core.abort(c.id)
    assert out.finish_reason == "abort" and len(out.token_ids) == c.num_output_tokens
    assert_pool_empty(core)
    # Aborting again, or an unknown id, is ignored.
    assert core.abort(c.id) is None and core.abort(10 ** 9) is None
    assert_pool_empty(core)
    # Preempted: two growing requests in the 8 blocks; one is pushed back to waiting.
    x = core.add_request(random_prompts(1, [20], seed=3)[0], params)
    y = core.add_request(random_prompts(1, [20], seed=4)[0], params)
    for _ in range(60):
        core.step()
        core.check_invariants()
        if core.totals["preemptions"]:
            break
    victim = x if x.status.value == "waiting" else y
    assert core.totals["preemptions"] and victim.status.value == "waiting" and not victim.block_table
    core.abort(victim.id)
    core.abort((y if victim is x else x).id)
    assert_pool_empty(core)


def test_request_outgrowing_the_whole_pool_finishes(tiny_path):
    """A prompt that fits the pool but whose generation outgrows it (39 + 60 tokens > 4 blocks of
    16) must end (e.g. finish_reason "length") and free its blocks; it must not preempt itself
    and then wait forever for blocks that do not exist, which would hang LLM.generate."""
    core = make_core(tiny_path, 4)
    seq = core.add_request(random_prompts(1, [39], seed=5)[0], greedy(60, ignore_eos=True))
    finished = []
    for _ in range(300):
        finished += [o for o in core.step() if o.finished]
        core.check_invariants()
        if not core.has_work():
            break
    assert core.has_work() is False, (
        f"request stuck after 300 steps: {seq!r}, status {seq.status.value}, "
        f"{seq.num_output_tokens} tokens generated, preemptions {core.totals['preemptions']}")
    assert len(finished) == 1 and finished[0].finish_reason in ("length", "error")
    assert_pool_empty(core)

