"""Continuous batching: batch invariance, chunked prefill, prefix caching and preemption all
leave greedy tokens unchanged."""

from __future__ import annotations

import pytest

from conftest import assert_pool_empty, greedy, random_prompts, tiny_llm

MIXED_LENGTHS = [3, 70, 17, 1, 45, 33, 8, 120, 16, 32, 5, 64, 27, 90, 2, 48]


class PrefillCounter:
    """Wraps a runner's `launch` to record how many tokens each prefill step computed."""

    def __init__(self, llm):
        self.runner = llm.engine.runner
        self.inner = self.runner.launch
        self.prefill_tokens = 0
        self.prefill_steps = 0
        self.max_step_tokens = 0
        self.batch_sizes = []

        def launch(batch, *rest):
            if batch.is_prefill:
                n = sum(batch.num_new_tokens[batch.num_decode:])  # a mixed step's decode tokens aside
                self.prefill_tokens += n
                self.prefill_steps += 1
                self.max_step_tokens = max(self.max_step_tokens, n)
            else:
                self.batch_sizes.append(len(batch.seqs))
            return self.inner(batch, *rest)

        self.runner.launch = launch

    def close(self):
        del self.runner.launch  # back to the class method


# ------------------------------------------------------------------------------------------
# Batch invariance


def test_batch_invariance_real_model(smol):
    """A prompt alone and inside a batch of 16 mixed-length prompts gets the same greedy tokens."""
    texts = [
        "The quick brown fox",
        "Write a haiku about autumn leaves falling on a quiet pond.",
        "1, 2, 3, 4,",
        "In 1969, the first humans landed on",
        "Water boils at",
        "List three uses of a paperclip:\n1.",
        "Translate to French: good morning",
        "The mitochondria is",
        "import numpy as np\n",
        "Q: What is the largest planet?\nA:",
        "Roses are red,",
        "Explain gravity to a child in one sentence.",
        "The best way to learn programming is",
        "SELECT * FROM",
        "Dear Sir or Madam,",
        "Hello",
    ]
    params = greedy(12, ignore_eos=True)
    batch = smol.generate(texts, params)
    for i in (1, 7, 15):
        alone = smol.generate([texts[i]], params)[0]
        assert alone.token_ids == batch[i].token_ids, f"prompt {i} differs alone vs in the batch"
        assert alone.text == batch[i].text
    assert len({tuple(o.token_ids) for o in batch}) > 10


@pytest.fixture(scope="module")
def tiny_alone(tiny_path):
    """Reference: every mixed-length prompt run on its own in a fresh engine without prefix cache."""
    prompts = random_prompts(16, MIXED_LENGTHS, seed=21)
    llm = tiny_llm(tiny_path, prefix_caching=False)
    params = greedy(20, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert len({tuple(t) for t in alone}) == len(prompts)
    return prompts, params, alone


def test_batch_invariance_tiny_model(tiny_path, tiny_alone):
    prompts, params, alone = tiny_alone
    llm = tiny_llm(tiny_path, prefix_caching=False)
    counter = PrefillCounter(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert counter.prefill_steps == 1, "all 16 prompts should be prefilled in one step"
    assert max(counter.batch_sizes) == 16, "and decoded together"
    assert_pool_empty(llm.engine)


@pytest.mark.parametrize("budget", [1, 7, 50])
def test_chunked_prefill_gives_the_same_tokens(tiny_path, tiny_alone, budget):
    """A tiny max_num_batched_tokens splits prompts into chunks (prefix read from the paged
    cache); tokens must not change."""
    prompts, params, alone = tiny_alone
    llm = tiny_llm(tiny_path, prefix_caching=False, max_num_batched_tokens=budget)
    counter = PrefillCounter(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert counter.max_step_tokens <= budget
    # (a prompt's last token may be computed by the decode step that samples from it)
    assert counter.prefill_steps >= (sum(MIXED_LENGTHS) - len(prompts)) // budget
    assert_pool_empty(llm.engine)


def test_requests_arriving_while_others_decode(tiny_path, tiny_alone):
    """Continuous batching: requests added mid-flight join the running batch, tokens unchanged."""
    prompts, params, alone = tiny_alone
    llm = tiny_llm(tiny_path, prefix_caching=False, max_num_batched_tokens=40)
    engine = llm.engine
    done = {}
    ids = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_work():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            ids[engine.add_request(p, params).id] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.id]] = out.token_ids
        engine.check_invariants()
        step += 1
        assert step < 2000
    assert [done[i] for i in range(len(prompts))] == alone
    assert_pool_empty(engine)


# ------------------------------------------------------------------------------------------
# Prefix cache


@pytest.mark.parametrize("prefix_len", [80, 96])
def test_prefix_cache_reuses_full_blocks_and_keeps_tokens(tiny_path, prefix_len):
    """Block size 16: a shared prefix of 80 tokens is 5 full blocks; of 96, 6 full blocks. A second
    request with that prefix skips the cached blocks' prefill and generates what it would without
    prefix caching."""
    prefix = random_prompts(1, [prefix_len], seed=31)[0]
    first = prefix + random_prompts(1, [9], seed=32)[0]
    second = prefix + random_prompts(1, [13], seed=33)[0]
    same_as_prefix = list(prefix)  # exactly the cached blocks: the last block must still be computed
    params = greedy(16, ignore_eos=True)

    plain = tiny_llm(tiny_path, prefix_caching=False)
    want = [plain.generate([p], params)[0].token_ids for p in (first, second, same_as_prefix)]

    llm = tiny_llm(tiny_path, prefix_caching=True)
    counter = PrefillCounter(llm)
    out1 = llm.generate([first], params)[0]
    assert out1.metrics["cached_prompt_tokens"] == 0
    assert counter.prefill_tokens == len(first)

    counter.prefill_tokens = 0
    out2 = llm.generate([second], params)[0]
    full_blocks = prefix_len // 16
    assert out2.metrics["cached_prompt_tokens"] == full_blocks * 16
    assert counter.prefill_tokens == len(second) - full_blocks * 16
    admitted = [e for e in llm.snapshot().events if e.kind == "admitted" and e.request == out2.id]
    assert len(admitted) == 1 and admitted[0].details["cached_tokens"] == full_blocks * 16
    assert llm.snapshot().totals["prefix_hit_tokens"] == full_blocks * 16

    counter.prefill_tokens = 0
    out3 = llm.generate([same_as_prefix], params)[0]
    # The block holding the last prompt token is never taken from the cache.
    assert out3.metrics["cached_prompt_tokens"] == (prefix_len - 1) // 16 * 16
    assert counter.prefill_tokens == prefix_len - (prefix_len - 1) // 16 * 16

    assert [out1.token_ids, out2.token_ids, out3.token_ids] == want
    assert_pool_empty(llm.engine)
    assert llm.snapshot().pool.cached > 0  # freed blocks keep their hash for later reuse


def test_prefix_cache_shared_between_concurrent_requests(tiny_path):
    """Requests sharing a cached prefix hold the same physical blocks at once (ref counted) and
    each still gets its own correct tokens."""
    prefix = random_prompts(1, [64], seed=41)[0]
    tails = random_prompts(4, [5, 11, 3, 20], seed=42)
    prompts = [prefix + t for t in tails]
    params = greedy(10, ignore_eos=True)
    plain = tiny_llm(tiny_path, prefix_caching=False)
    want = [o.token_ids for o in plain.generate(prompts, params)]

    llm = tiny_llm(tiny_path)
    engine = llm.engine
    llm.generate([prefix + [7]], greedy(1))  # warm the cache with the prefix's 4 full blocks
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.step()  # prefill all four
    snap = engine.snapshot()
    tables = {r.id: r.block_table for r in snap.requests}
    heads = {tables[s.id][:4] for s in seqs}
    assert len(heads) == 1, "all four requests should share the four cached prefix blocks"
    for r in snap.requests:
        assert r.blocks_shared == 4 and r.block_roles[:4] == ("shared",) * 4
    engine.check_invariants()
    done = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                done[out.id] = out
        engine.check_invariants()
    assert [done[s.id].token_ids for s in seqs] == want
    assert all(done[s.id].metrics["cached_prompt_tokens"] == 64 for s in seqs)
    assert_pool_empty(engine)


def test_identical_prompts_in_one_batch(tiny_path):
    """Identical prompts admitted together (nothing cached yet) all get identical tokens, and a
    later identical prompt reuses their blocks."""
    prompt = random_prompts(1, [50], seed=51)[0]
    llm = tiny_llm(tiny_path)
    outs = llm.generate([prompt] * 4, greedy(12, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) == 1
    again = llm.generate([prompt], greedy(12, ignore_eos=True))[0]
    assert again.token_ids == outs[0].token_ids
    assert again.metrics["cached_prompt_tokens"] == 48
    assert_pool_empty(llm.engine)


# ------------------------------------------------------------------------------------------
# Preemption


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_keeps_tokens(tiny_path, prefix_caching):
    """Twelve requests that each grow to 4-6 blocks of 16 in a pool of 14 blocks: the scheduler
    must preempt (free and recompute), and every request still gets the big-pool tokens."""
    prompts = random_prompts(12, [20, 35, 9, 41], seed=61)
    params = greedy(40, ignore_eos=True)
    big = tiny_llm(tiny_path, prefix_caching=prefix_caching)
    want = [o.token_ids for o in big.generate(prompts, params)]
    assert big.snapshot().totals["preemptions"] == 0

    small = tiny_llm(tiny_path, prefix_caching=prefix_caching, num_kv_blocks=14)
    outs = small.generate(prompts, params)
    snap = small.snapshot()
    assert snap.totals["preemptions"] > 0
    assert any(o.metrics["preemptions"] > 0 for o in outs)
    assert any(e.kind == "preempted" for e in snap.events)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    assert_pool_empty(small.engine)


def test_preemption_step_by_step_keeps_invariants(tiny_path):
    prompts = random_prompts(10, [30, 12, 47], seed=71)
    params = greedy(30, ignore_eos=True)
    llm = tiny_llm(tiny_path, num_kv_blocks=12)
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    finished = {}
    steps = 0
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finished[out.id] = out
        engine.check_invariants()
        snap = engine.snapshot()
        assert snap.pool.used + snap.pool.free == snap.pool.total
        assert snap.pool.used <= 12
        steps += 1
        assert steps < 3000, "no progress"
    assert engine.totals["preemptions"] > 0
    assert sorted(finished) == sorted(s.id for s in seqs)
    assert all(len(o.token_ids) == 30 for o in finished.values())
    assert_pool_empty(engine)
