"""Mixed steps: while a long prompt is prefilled in chunks, every running request keeps getting a
token each step, and greedy output (compressed or not) is the same as with steps that are all
prefill or all decode (docs/design-notes.md, "Scheduling")."""

from __future__ import annotations

import pytest

from compression_helpers import (assert_drained, build_random_model, check_step, greedy, make_engine, random_prompts,
                                 run)

CHUNK = 24  # the step's token budget: a 300-token prompt needs a dozen steps beside the decoders


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-mixed"), "qwen3-tiny", seed=5)


def tokens_per_step_while_prefilling(engine, long_prompt) -> tuple[list[list[int]], list]:
    """Start two decoders, then submit `long_prompt`; for every step while it is in prefill, how many
    tokens each decoder gained. Also the steps' batches as the runner saw them."""
    decoders = [engine.add_request(p, greedy(400)) for p in random_prompts(2, [12, 20], seed=1)]
    while any(s.num_output_tokens == 0 for s in decoders):  # both prefilled and decoding
        engine.step()
        check_step(engine)
    batches, launch = [], engine.runner.launch

    def record(batch, *rest):
        batches.append(batch)
        return launch(batch, *rest)

    engine.runner.launch = record
    long = engine.add_request(long_prompt, greedy(5))
    gains = []
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in decoders]
        engine.step()
        check_step(engine)
        gains.append([s.num_output_tokens - b for s, b in zip(decoders, before)])
    del engine.runner.launch
    for seq in decoders + [long]:
        engine.abort(seq.id)
    assert_drained(engine)
    return gains, batches


@pytest.mark.parametrize("compression", [True, False], ids=["compressed", "full-kv"])
def test_every_decoder_gets_a_token_in_every_step_while_a_long_prompt_fills(model_path, compression):
    engine = make_engine(model_path, compression=compression, max_num_batched_tokens=CHUNK, num_kv_blocks=96)
    try:
        gains, batches = tokens_per_step_while_prefilling(engine, random_prompts(1, [300], seed=2)[0])
    finally:
        engine.close()
    assert len(gains) >= 300 // CHUNK  # the prompt really was chunked
    # Compressing requests skip decode until their compaction lands; every other step gives each a token.
    assert sum(g == [1, 1] for g in gains) >= len(gains) - 4 * compression, gains
    assert all(max(g) <= 1 for g in gains)
    mixed = [b for b in batches if b.is_mixed]
    assert len(mixed) >= len(gains) - 4 * compression
    for b in mixed:  # decoders first, then one chunk, within the step's budget
        assert b.num_new_tokens[:b.num_decode] == [1] * b.num_decode
        assert sum(b.num_new_tokens) <= CHUNK


def test_without_mixed_steps_the_decoders_wait_for_the_prompt(model_path):
    """The older schedule, for contrast: a step is prefill or decode, so the streams stop."""
    engine = make_engine(model_path, max_num_batched_tokens=CHUNK, num_kv_blocks=96, mixed_steps=False)
    try:
        gains, batches = tokens_per_step_while_prefilling(engine, random_prompts(1, [300], seed=2)[0])
    finally:
        engine.close()
    assert gains.count([0, 0]) >= 300 // CHUNK - 1
    assert not any(b.is_mixed for b in batches)


@pytest.mark.parametrize("chunk", [7, 16, 40])
def test_greedy_output_is_the_same_with_mixed_steps_or_without(model_path, chunk):
    """Compressed (budget 2 blocks of 16), batched, chunked and in a pool of 8 blocks (a preemption):
    mixed steps change when tokens are computed, never which."""
    prompts = random_prompts(5, [3, 70, 17, 45, 33], seed=chunk)
    results = {}
    for mixed in (True, False):
        engine = make_engine(model_path, max_num_batched_tokens=chunk, num_kv_blocks=8, mixed_steps=mixed)
        batches, launch = [], engine.runner.launch
        engine.runner.launch = lambda batch, *rest: batches.append(batch) or launch(batch, *rest)
        try:
            seqs = [engine.add_request(p, greedy(50)) for p in prompts]
            done = run(engine)
            assert_drained(engine)
            results[mixed] = [done[s.id].token_ids for s in seqs]
        finally:
            engine.close()
        assert engine.totals["compressions"] > 0 and engine.totals["preemptions"] > 0
        assert any(b.is_mixed for b in batches) == mixed
    assert results[True] == results[False]


def test_a_prompt_admitted_in_the_step_that_compresses_the_request_it_shares_with(model_path):
    """A's prompt is longer than its budget, so it is compressed right after its prefill; B, sharing
    A's first three blocks, arrives then and is admitted in that same step (compression planned first).
    Both answer as they do alone: A compacts into blocks B does not read."""
    prefix = random_prompts(1, [48], seed=21)[0]
    prompts = [prefix + [7] * 20, prefix + [1, 2]]
    alone = []
    for p in prompts:
        engine = make_engine(model_path, max_cache_blocks_per_seq=4, window=4, num_kv_blocks=64)
        try:
            seq = engine.add_request(p, greedy(60))
            alone.append(run(engine)[seq.id].token_ids)
        finally:
            engine.close()
    engine = make_engine(model_path, max_cache_blocks_per_seq=4, window=4, num_kv_blocks=64, async_compress=False)
    try:
        a = engine.add_request(prompts[0], greedy(60))
        engine.step()
        b = engine.add_request(prompts[1], greedy(60))
        batches, launch = [], engine.runner.launch
        engine.runner.launch = lambda batch, *rest: batches.append(batch) or launch(batch, *rest)
        engine.step()
        assert a.times_compressed == 1 and b in batches[0].admitted  # the same step
        assert b.num_cached_prefix_tokens == 48
        shared = b.block_table[:3]
        assert not set(a.block_table) & set(shared)
        done = run(engine)
        assert_drained(engine)
    finally:
        engine.close()
    assert [done[a.id].token_ids, done[b.id].token_ids] == alone
