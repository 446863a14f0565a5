"""Prefix caching survives compression: a compressed request's prompt blocks go back to the pool still
hashed, so requests that arrive after it are served the shared prefix from the cache, with the same
greedy output as on a fresh engine; and compaction never writes a block the cache or another
request maps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from compression_helpers import assert_drained, build_random_model, check_step, greedy, make_engine, random_prompts, run

torch.set_num_threads(1)
BS, W = 16, 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-prefix"), "qwen3-tiny", seed=5)


def alone(model_path, prompt, max_tokens, **knobs) -> list[int]:
    engine = make_engine(model_path, prefix_caching=False, **knobs)
    try:
        seq = engine.add_request(prompt, greedy(max_tokens))
        return run(engine)[seq.id].token_ids
    finally:
        engine.close()


@pytest.mark.parametrize("budget,a_suffix,a_tokens,kv_dtype", [
    (2, 10, 20, "auto"),   # A's prompt (90 tokens) is over the budget: compressed right after its prefill
    (4, 10, 20, "auto"),
    (8, 2, 80, "auto"),    # A's prompt fits; A is compressed during decode, several times
    (8, 2, 80, "fp8"),     # a cached 8-bit block keeps its scales
    (8, 2, 80, "int8"),
])
def test_a_later_request_is_served_the_prefix_of_a_compressed_one(model_path, budget, a_suffix, a_tokens, kv_dtype):
    prefix = random_prompts(1, [5 * BS], seed=budget)[0]
    a_prompt = prefix + random_prompts(1, [a_suffix], seed=100 + budget)[0]
    b_prompt = prefix + random_prompts(1, [12], seed=200 + budget)[0]
    knobs = dict(max_cache_blocks_per_seq=budget, window=W, num_kv_blocks=64, kv_cache_dtype=kv_dtype)
    engine = make_engine(model_path, **knobs)
    try:
        a = engine.add_request(a_prompt, greedy(a_tokens))
        run(engine)
        assert a.times_compressed >= 1
        b = engine.add_request(b_prompt, greedy(30))
        engine.step()  # B's prefill: the pane marks the blocks it got from the cache
        roles = [r for r in engine.snapshot().requests if r.id == b.id][0].block_roles
        assert roles[:b.num_cached_prefix_tokens // BS] == ("reused",) * (b.num_cached_prefix_tokens // BS)
        out = run(engine)[b.id].token_ids
        assert_drained(engine)
        admitted = [e for e in engine.events if e.kind == "admitted" and e.request == b.id][0]
    finally:
        engine.close()
    # Every full prefix block, up to the window rule (B's window positions are always computed).
    window_start = (len(b_prompt) if len(b_prompt) > budget * BS else (budget + 1) * BS) - W
    served = min(5 * BS, window_start // BS * BS)
    assert b.num_cached_prefix_tokens == served > 0
    assert admitted.details["cached_tokens"] == served
    assert out == alone(model_path, b_prompt, 30, **knobs)


def test_under_pressure_the_cache_yields_to_running_requests(model_path):
    """With no spare blocks a compression overwrites its own cached blocks rather than preempt
    anyone: the outputs stay exact and nothing leaks."""
    prompts = random_prompts(3, [40, 44, 47], seed=9)
    engine = make_engine(model_path, max_cache_blocks_per_seq=2, window=W, num_kv_blocks=9)
    try:
        seqs = [engine.add_request(p, greedy(40)) for p in prompts]
        done = run(engine)
        assert engine.totals["compressions"] >= 3
        assert_drained(engine)
    finally:
        engine.close()
    for s, p in zip(seqs, prompts):
        assert done[s.id].token_ids == alone(model_path, p, 40, max_cache_blocks_per_seq=2, window=W,
                                             num_kv_blocks=64)


def test_multi_turn_conversation_reuses_the_earlier_turns(model_path):
    """Turn 2 repeats turn 1's prompt and its answer: every cached block of turn 1's prompt (and of the
    part of the answer written before the first compression) is reused."""
    engine = make_engine(model_path, max_cache_blocks_per_seq=3, window=W, num_kv_blocks=64)
    try:
        turn1 = random_prompts(1, [40], seed=31)[0]
        first = engine.add_request(turn1, greedy(30))
        answer = run(engine)[first.id].token_ids
        assert first.times_compressed >= 1  # 40 + 30 > the 64-entry trigger
        turn2 = turn1 + answer + random_prompts(1, [9], seed=32)[0]
        second = engine.add_request(turn2, greedy(10))
        run(engine)
        assert_drained(engine)
    finally:
        engine.close()
    # Blocks hashed before turn 1's first compression cover its first 64 positions (4 blocks); turn 2's
    # prompt (79 tokens) is over the 48-token budget, so its window starts at 75: 4 blocks qualify.
    assert second.num_cached_prefix_tokens == 4 * BS


class CompactionWatch:
    """Wraps the compressor: before each compaction, copies every block that the prefix cache or
    another live request maps, and checks after it that none of them changed."""

    def __init__(self, engine):
        self.engine, self.checked, self.compactions = engine, 0, 0
        inner = engine.compressor.execute

        def execute(job):
            protected = self.protected(job)
            before = engine.runner.kv_cache[:, :, protected].clone()
            inner(job)
            after = engine.runner.kv_cache[:, :, protected]
            assert torch.equal(before, after), "compaction wrote a block the cache or another request maps"
            self.checked += len(protected)
            self.compactions += 1

        engine.compressor.execute = execute

    def protected(self, job) -> list[int]:
        blocks = self.engine.blocks
        mine = set(job.targets) | {job.decode_block}
        others = {b for s in self.engine.scheduler.live() if s is not job.seq for b in s.block_table}
        cached = {b.id for b in blocks.blocks if blocks.is_cached(b.id)}
        assert not mine & (others | cached), "a compression target is mapped by the cache or another request"
        return sorted(others | cached)


@settings(max_examples=20, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 40), st.integers(0, 6)),
                         min_size=2, max_size=7),
       pool=st.integers(8, 30), seed=st.integers(0, 1000))
def test_random_arrivals_sharing_prefixes_keep_exact_accounting(model_path, requests, pool, seed):
    prefixes = random_prompts(3, [3 * BS, 2 * BS + 5, 4 * BS], seed=seed)
    engine = make_engine(model_path, max_cache_blocks_per_seq=2, window=W, num_kv_blocks=pool, async_compress=False)
    watch = CompactionWatch(engine)
    try:
        arrivals, finished = {}, {}
        for i, (which, extra, max_tokens, arrival) in enumerate(requests):
            arrivals.setdefault(arrival, []).append(
                (prefixes[which] + random_prompts(1, [extra + 1], seed=seed + i)[0], max_tokens))
        step = 0
        while step < 3000 and (engine.has_work() or step <= max(arrivals)):
            for prompt, max_tokens in arrivals.get(step, []):
                if engine.blocks.blocks_for(len(prompt) + 1) <= pool:
                    engine.add_request(prompt, greedy(max_tokens))
            for out in engine.step():
                if out.finished:
                    finished[out.id] = out
            check_step(engine)
            step += 1
        assert not engine.has_work()
        assert all(o.finish_reason == "length" for o in finished.values())
        assert watch.compactions == engine.totals["compressions"]
        assert_drained(engine)
    finally:
        engine.close()
