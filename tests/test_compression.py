"""Compressed PagedAttention in the engine (docs/design-notes.md, "The score" and "Compression"):
token parity when nothing is compressed, the N_max bound and exact pool accounting under random
workloads, the window that is always kept, shared prefix blocks never written, compressed requests
never preempted, async vs sync compression, aborts during a compression, and what snapshots and
events report.

The kernel-level tests (compaction, selection, scoring against naive references) live in
test_compression_kernels.py. Engines here use block size 16, window 4..8 and budgets of 2..4 blocks so that compressions happen
every few dozen tokens on a tiny random-weight model with varied greedy output."""

from __future__ import annotations

import itertools
import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from compression_helpers import (assert_drained, build_random_model, check_step, generate, greedy,
                                 make_engine, random_prompts, read_blocks, read_kv, run, slots_of)
from zipage.engine.sequence import Status

torch.set_num_threads(1)  # tiny ops: one thread is fastest and steady on a shared CPU


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-qwen3"), "qwen3-tiny", seed=0)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-llama"), "llama-tiny", seed=1)


def varied(outputs: list[list[int]]) -> bool:
    """Whether greedy outputs are varied enough for a token comparison to mean something."""
    return all(len(set(o)) >= max(2, len(o) // 5) for o in outputs if len(o) >= 10)


# ------------------------------------------------------------------------------------------
# 1. A budget that is never reached changes nothing


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("hybrid,slots", [(True, 1), (False, None)])
def test_unreached_budget_gives_the_same_tokens(model_path, llama_path, family, hybrid, slots):
    path = model_path if family == "qwen3" else llama_path
    # Budget n*b = 128 tokens; compression would trigger at (n+1)*b = 144 KV entries. The longest
    # request ends with 44 + 100 = 144 tokens, i.e. 143 KV entries: right below the trigger.
    prompts = random_prompts(4, [5, 20, 44, 1], seed=3)
    max_tokens = [60, 70, 100, 40]
    knobs = dict(max_cache_blocks_per_seq=8, window=8, num_kv_blocks=64)
    full, _ = generate(path, prompts, max_tokens, **dict(knobs, compression=False))
    comp, totals = generate(path, prompts, max_tokens, hybrid_scheduling=hybrid, num_query_slots=slots,
                            **knobs)
    assert totals["compressions"] == 0
    assert [len(o) for o in comp] == max_tokens
    assert varied(full), full
    assert comp == full


# ------------------------------------------------------------------------------------------
# 2. Random workloads: invariants after every step, the N_max bound, everything freed at the end

PREFIXES = random_prompts(2, [40, 23], seed=99)

request_st = st.fixed_dictionaries({
    "arrival": st.one_of(st.just(0), st.integers(0, 5), st.integers(0, 40)),
    "length": st.one_of(st.integers(1, 30), st.integers(1, 30), st.integers(31, 100)),
    "prefix": st.sampled_from([None, None, 0, 1]),
    "max_tokens": st.one_of(st.integers(40, 90), st.integers(40, 90), st.integers(1, 39)),
    "ignore_eos": st.booleans(),
    "abort": st.sampled_from([None, None, None, 5, 30, "compressing", "compressing", "compressing"]),
})
config_st = st.fixed_dictionaries({
    "async_compress": st.booleans(),
    "hybrid_scheduling": st.sampled_from([True, True, False]),
    "num_query_slots": st.one_of(st.integers(1, 2), st.integers(3, 6)),
    "num_kv_blocks": st.one_of(st.integers(8, 10), st.integers(8, 20)),
    "max_cache_blocks_per_seq": st.integers(2, 3),
    "window": st.sampled_from([4, 8]),
    "prefix_caching": st.booleans(),
    "max_num_batched_tokens": st.sampled_from([24, 64, 4096]),
    "max_num_seqs": st.sampled_from([8, 8, 3]),
})


@st.composite
def workloads(draw):
    """A config and a list of requests; half of the workloads add a burst of short requests at step 0
    on a tiny pool, which forces preemptions."""
    config = draw(config_st)
    requests = draw(st.lists(request_st, min_size=2, max_size=7))
    if draw(st.booleans()):
        config["num_kv_blocks"] = draw(st.integers(7, 9))
        config["max_num_seqs"] = 8
        burst = draw(st.lists(st.fixed_dictionaries({
            "arrival": st.integers(0, 3), "length": st.integers(1, 45), "prefix": st.sampled_from([None, 0, 0]),
            "max_tokens": st.integers(30, 70), "ignore_eos": st.just(True),
            "abort": st.sampled_from([None, None, "compressing"])}), min_size=3, max_size=5))
        requests = burst + requests
    return config, requests


def check_slot_rules(engine) -> None:
    """A request holds a query slot whenever its next KV entry falls in the window (hybrid), and
    every running request holds one without hybrid scheduling."""
    cfg = engine.config
    trigger = (cfg.max_cache_blocks_per_seq + 1) * engine.block_size
    for seq in engine.scheduler.running:
        if seq.query_slot is None:
            assert cfg.hybrid_scheduling, f"request {seq.id} runs without a slot"
            assert seq.kv_len <= trigger - cfg.window, f"request {seq.id} decoded into the window without a slot"
            assert seq.status is not Status.COMPRESSING
    for seq in engine.scheduler.waiting:  # a waiting (or preempted) request holds nothing
        assert not seq.block_table and not seq.pending_blocks and seq.query_slot is None


# Shrinking a failure of this test can take minutes: it is left out to keep the suite fast (the failing
# example is still printed). ZIPAGE_EXAMPLES raises the example count for a deeper local search.
@settings(max_examples=int(os.environ.get("ZIPAGE_EXAMPLES", "30")), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), seed=st.integers(0, 1000))
def test_random_workloads_keep_the_bound_and_free_everything(model_path, workload, seed):
    config, requests = workload
    engine = make_engine(model_path, **config)
    gen = torch.Generator().manual_seed(seed)
    try:
        prompts = []
        for r in requests:
            own = torch.randint(1, 256, (r["length"],), generator=gen).tolist()
            if r["prefix"] is not None:
                shared = PREFIXES[r["prefix"]][:r["length"] - 1]
                own = shared + own[len(shared):]
            prompts.append(own)
        seqs: dict[int, object] = {}
        finished = {}
        aborted = set()
        n_max = config["max_cache_blocks_per_seq"] + 1
        compressed_once = set()
        step = 0
        while step < 4000:
            for i, r in enumerate(requests):
                if r["arrival"] == step:
                    seqs[i] = engine.add_request(prompts[i], greedy(r["max_tokens"], ignore_eos=r["ignore_eos"]))
            if step > max(r["arrival"] for r in requests) and not engine.has_work():
                break
            for out in engine.step():
                if out.finished:
                    assert out.id not in finished
                    finished[out.id] = out
            step += 1
            check_step(engine)
            check_slot_rules(engine)
            for seq in engine.scheduler.live():
                if seq.is_compressed:
                    compressed_once.add(seq.id)
                if seq.id in compressed_once:  # once compressed, always bounded (in flight included)
                    assert len(seq.block_table) <= n_max and len(seq.block_table) + len(seq.pending_blocks) <= n_max
            for i, r in enumerate(requests):
                seq = seqs.get(i)
                if seq is None or seq.id in finished:
                    continue
                in_flight = seq.id in engine.jobs
                if (r["abort"] == "compressing" and in_flight) or (
                        isinstance(r["abort"], int) and step == r["arrival"] + r["abort"] + 1):
                    out = engine.abort(seq.id)
                    assert out is not None and out.finished and out.finish_reason == "abort"
                    finished[out.id] = out
                    aborted.add(seq.id)
                    engine.check_invariants()
        assert not engine.has_work(), f"stuck after {step} steps: {engine.scheduler.live()}"
        assert_drained(engine)
        assert len(finished) == len(requests)
        for i, r in enumerate(requests):
            out = finished[seqs[i].id]
            assert out.finish_reason in ("length", "stop", "abort"), (out.finish_reason, out.error)
            if out.finish_reason == "abort":
                assert out.id in aborted
            elif out.finish_reason == "length":
                assert len(out.token_ids) == r["max_tokens"]
            else:
                assert not r["ignore_eos"] and out.token_ids[-1] in engine.eos_token_ids
        assert engine.totals["compressions"] >= len(compressed_once)
        # Coverage of the interesting cases (see pytest --hypothesis-show-statistics).
        event(f"compressed: {engine.totals['compressions'] > 0}")
        event(f"preempted: {engine.totals['preemptions'] > 0}")
        in_flight_aborts = [i for i, r in enumerate(requests) if r["abort"] == "compressing" and seqs[i].id in aborted]
        event(f"aborted in flight: {bool(in_flight_aborts)}")
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------
# 3. The window is always kept, as the last w entries of the kept set


class ExecuteSpy:
    """Wraps compressor.execute: records, before each compression, the K/V (all layers) of the
    request's last `window` entries and first sink entries, read through the job's source table."""

    def __init__(self, engine, gate: threading.Event | None = None):
        self.engine = engine
        self.inner = engine.compressor.execute
        self.gate = gate
        self.started = threading.Event()
        self.records = []  # (job, window_kv, sink_kv, targets_free_when_writing, (leading, newest) kept)
        engine.compressor.execute = self

    def __call__(self, job):
        e = self.engine
        bs, sinks = e.block_size, e.config.num_sink_tokens
        # every newest entry that must stay (the recent share while decoding, after the prompt's share)
        protected = job.kept
        w = protected[1]
        window_kv = read_kv(e, slots_of(job.source_table, range(job.kv_len - w, job.kv_len), bs))
        sink_kv = read_kv(e, slots_of(job.source_table, range(sinks), bs))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "test gate never opened"
        free = set(e.blocks.free_ids)
        written_while_free = [b for b in job.targets if b in free]
        self.records.append((job, window_kv, sink_kv, written_while_free, protected))
        return self.inner(job)


@pytest.mark.parametrize("async_compress", [False, True])
@pytest.mark.parametrize("eviction,sinks,share", [("score", 0, 0.0), ("score", 3, 0.0), ("score", 0, 0.625),
                                                  ("random", 0, 0.0), ("random", 1, 0.5), ("recent", 2, 0.0)])
def test_last_window_entries_are_always_kept(model_path, async_compress, eviction, sinks, share):
    engine = make_engine(model_path, async_compress=async_compress, eviction=eviction, num_sink_tokens=sinks,
                         recent_share=share, window=8, max_cache_blocks_per_seq=2)
    spy = ExecuteSpy(engine)
    n, bs = 2, engine.block_size
    # The recent share applies to score eviction only: 0.625 of 2 blocks of 16 is 20 entries.
    w = 20 if (eviction, share) == ("score", 0.625) else 8
    assert engine.compressor.protected(0, True)[1] == w
    keep = n * bs
    checked = set()

    def after_landing(e):
        for job, window_kv, sink_kv, *_ in spy.records:
            if id(job) in checked or e.jobs.get(job.seq.id) is job:
                continue  # not landed yet
            checked.add(id(job))
            if job.seq.block_table:  # still live: its table is the targets plus the decode block
                assert job.seq.block_table[:n] == job.targets
                assert job.seq.block_table[n] == job.decode_block
            kept = read_kv(e, slots_of(job.targets, range(keep), bs))  # [layers, 2, keep, heads, dim]
            assert torch.equal(kept[:, :, keep - window_kv.shape[2]:], window_kv), "the newest entries were not kept last"
            assert torch.equal(kept[:, :, :sinks], sink_kv), "sink tokens were not kept first"

    try:
        # One prompt longer than the budget (compressed right after prefill), others decode into it.
        prompts = random_prompts(3, [10, 70, 30], seed=5)
        for p in prompts:
            engine.add_request(p, greedy(70))
        done = run(engine, on_step=after_landing)
        assert [(o.finish_reason, o.error) for o in done.values()] == [("length", None)] * 3
        assert_drained(engine)
    finally:
        engine.close()
    assert engine.totals["compressions"] >= 6
    assert len(checked) == len(spy.records) == engine.totals["compressions"]
    assert all(not r[3] for r in spy.records), "compaction wrote into blocks on the free list"


# ------------------------------------------------------------------------------------------
# The query cache holds the window's queries (checked against transformers)


@pytest.mark.parametrize("hybrid", [True, False])
def test_query_cache_holds_the_queries_of_the_window(model_path, monkeypatch, hybrid):
    """At each compression the request's slot rows hold the rotated queries of its last w token
    positions. Oracle: transformers' own forward of the same tokens (queries captured at RoPE). Before
    the first compression nothing was evicted, so every layer must match; later, only layer 0 (whose
    queries depend on the tokens and positions alone) is comparable with the full-attention oracle."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    w = 4
    engine = make_engine(model_path, async_compress=False, window=w, max_cache_blocks_per_seq=2, num_query_slots=1,
                         hybrid_scheduling=hybrid, max_num_batched_tokens=32)  # chunked prefill too
    records = []
    inner = engine.compressor.execute

    def spy(job):
        rows = [job.seq.query_slot * w + j % w for j in range(job.kv_len - w, job.kv_len)]  # oldest first
        records.append((job.first, list(job.seq.token_ids[:job.seq.num_computed_tokens]),
                        engine.runner.query_cache[:, rows].clone()))
        return inner(job)

    engine.compressor.execute = spy
    # A prompt that decodes into the window, one longer than the budget (window written at prefill,
    # in chunks), and one that waits for the single slot under hybrid scheduling.
    for p, m in zip(random_prompts(3, [10, 60, 20], seed=81), [60, 30, 50]):
        engine.add_request(p, greedy(m))
    run(engine)
    assert_drained(engine)
    engine.close()
    assert sum(1 for r in records if r[0]) == 3 and len(records) >= 6

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    captured = []
    rotate = modeling_qwen3.apply_rotary_pos_emb

    def capture(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = rotate(q, k, cos, sin, *args, **kwargs)
        captured.append(q_embed[0].transpose(0, 1))  # [tokens, heads, head_dim]
        return q_embed, k_embed

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", capture)
    with torch.no_grad():
        for first, tokens, rows in records:
            captured.clear()
            hf(torch.tensor([tokens]))
            want = torch.stack([q[-w:] for q in captured])  # [layers, w, heads, head_dim]
            if first:
                torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)
            else:
                torch.testing.assert_close(rows[0], want[0], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# 6. Shared prefix blocks are never written by a compression


@pytest.mark.parametrize("async_compress", [False, True])
def test_shared_prefix_blocks_stay_bit_identical(model_path, async_compress):
    """A and B share a 3-block prefix with H, which has no query slot (2 slots, hybrid scheduling) and
    so stops at the window start, holding the prefix while A and B are compressed again and again.
    C arrives later with the same prefix and must find it cached and intact."""
    knobs = dict(max_cache_blocks_per_seq=4, window=4, num_kv_blocks=64, async_compress=async_compress,
                 num_query_slots=2, hybrid_scheduling=True)
    bs = 16
    prefix = random_prompts(1, [3 * bs], seed=11)[0]  # three full blocks
    suffixes = random_prompts(4, [4, 12, 1, 9], seed=12)
    prompts = [prefix + s for s in suffixes]  # A, B, H, C
    max_tokens = [100, 90, 60, 40]

    def drive(prefix_caching: bool):
        engine = make_engine(model_path, prefix_caching=prefix_caching, **knobs)
        state = {"checks_after_compression": 0, "c_cached": None}
        done = {}

        def step():
            for out in engine.step():
                if out.finished:
                    done[out.id] = out
            check_step(engine)

        seqs = [engine.add_request(prompts[0], greedy(max_tokens[0]))]
        step()  # A alone: its prefix blocks are committed to the prefix cache
        seqs += [engine.add_request(prompts[i], greedy(max_tokens[i])) for i in (1, 2)]
        step()  # B and H are admitted on A's three cached blocks
        a, b, h = seqs
        if prefix_caching:
            assert b.num_cached_prefix_tokens == h.num_cached_prefix_tokens == 3 * bs
            assert a.block_table[:3] == b.block_table[:3] == h.block_table[:3]
            shared = list(a.block_table[:3])
            clone = read_blocks(engine, shared)
        while engine.has_work():
            step()
            if prefix_caching:
                blocks = engine.blocks
                registered = all(blocks.hash_to_block.get(blocks.blocks[x].hash) == x for x in shared)
                refs = [blocks.blocks[x].ref_count for x in shared]
                if min(refs) > 1 or registered:  # still shared, or still offered by the prefix cache
                    assert torch.equal(read_blocks(engine, shared), clone), "a shared block was written"
                    if a.times_compressed >= 2 and b.times_compressed >= 2 and min(refs) > 1:
                        state["checks_after_compression"] += 1
            if len(seqs) == 3 and a.times_compressed >= 2 and b.times_compressed >= 2:
                seqs.append(engine.add_request(prompts[3], greedy(max_tokens[3])))
        if prefix_caching:
            state["c_cached"] = next(ev.details["cached_tokens"] for ev in engine.events
                                     if ev.kind == "admitted" and ev.request == seqs[3].id)
        assert_drained(engine)
        engine.close()
        return [done[s.id].token_ids for s in seqs], [done[s.id].metrics["times_compressed"] for s in seqs], state

    tokens, times, state = drive(True)
    assert times[0] >= 3 and times[1] >= 3 and times[2] >= 1, times
    assert state["checks_after_compression"] > 0
    assert state["c_cached"] == 3 * bs, "the fourth request should have reused the untouched prefix"
    base_tokens, base_times, _ = drive(False)
    assert varied(base_tokens)
    assert tokens == base_tokens
    assert times == base_times


def test_compression_of_a_request_sharing_its_prefix_uses_fresh_targets(model_path):
    """While another request still references the prefix, the compressing one writes only into its
    private blocks and fresh ones, and drops its references to the shared blocks."""
    # Steps that do not mix: B's prefill takes a step of its own, so B shares the prefix before A's
    # compression is planned (mixed, both would come in one step, the compression planned first).
    engine = make_engine(model_path, max_cache_blocks_per_seq=4, window=4, num_kv_blocks=64, async_compress=False,
                         mixed_steps=False)
    prefix = random_prompts(1, [48], seed=21)[0]
    a = engine.add_request(prefix + [7] * 20, greedy(60))
    engine.step()
    b = engine.add_request(prefix + [1, 2], greedy(60))  # shorter: A compresses while B still shares
    engine.step()
    shared = list(a.block_table[:3])
    assert b.block_table[:3] == shared
    clone = read_blocks(engine, shared)
    spy = ExecuteSpy(engine)
    while a.times_compressed == 0:
        engine.step()
        check_step(engine)
    job = spy.records[0][0]
    assert not set(job.targets + [job.decode_block]) & set(shared)
    assert not set(a.block_table) & set(shared)
    assert [engine.blocks.blocks[x].ref_count for x in shared] == [1, 1, 1]  # only B now
    assert torch.equal(read_blocks(engine, shared), clone)
    run(engine)
    assert_drained(engine)
    engine.close()


# ------------------------------------------------------------------------------------------
# Prefix caching, fresh-block reservation and sink tokens under compression


def test_prefix_cache_hit_does_not_skip_the_window_queries(model_path):
    """A prompt longer than the budget is compressed right after its prefill, scored by the queries
    of its last w positions. When those positions fall in a block served by the prefix cache, their
    queries must still reach the query cache: scores and tokens equal a run without prefix caching."""
    bs, w = 16, 4
    prefix = random_prompts(1, [4 * bs], seed=7)[0]  # four full blocks
    # B = prefix + 1 token: 65 tokens > the 48-entry trigger. Its window is positions 61..64, and
    # 61..63 lie in the prefix's 4th block, a prefix-cache hit once A has been prefilled.
    prompts = [prefix + [5] * 10, prefix + [9]]
    runs = {}
    for prefix_caching in (True, False):
        engine = make_engine(model_path, prefix_caching=prefix_caching, async_compress=False, window=w)
        windows = {}
        inner = engine.compressor.execute

        def spy(job, engine=engine, windows=windows, inner=inner):
            rows = [job.seq.query_slot * w + j % w for j in range(job.kv_len - w, job.kv_len)]
            windows.setdefault(job.seq.id, engine.runner.query_cache[:, rows].clone())  # first compression
            return inner(job)

        engine.compressor.execute = spy
        a = engine.add_request(prompts[0], greedy(30))
        engine.step()
        b = engine.add_request(prompts[1], greedy(30))
        done = run(engine)
        assert_drained(engine)
        engine.close()
        # The cache serves only the blocks before the window (61..64): 3 of the 4 prefix blocks.
        assert b.num_cached_prefix_tokens == (3 * bs if prefix_caching else 0)
        runs[prefix_caching] = (windows[b.id], done[a.id].token_ids, done[b.id].token_ids)
    cached, plain = runs[True], runs[False]
    assert plain[1] == cached[1]  # A never hit the cache
    torch.testing.assert_close(cached[0], plain[0], rtol=1e-4, atol=1e-4,
                               msg="window queries of cache-hit positions are missing from the query cache")
    assert cached[2] == plain[2]


def test_concurrent_compressions_needing_fresh_blocks_do_not_crash(model_path):
    """A and B share a 2-block prefix and hit the trigger in the same step; each needs 2 fresh blocks
    (it may not write the shared ones) but only 3 are free. The engine must serialize or defer them
    (B's prefix becomes private once A's compression lands), not raise out of step()."""
    prefix = random_prompts(1, [32], seed=7)[0]
    engine = make_engine(model_path, async_compress=True, num_kv_blocks=7)
    try:
        a = engine.add_request(prefix + [5] * 4, greedy(30))
        engine.step()
        b = engine.add_request(prefix + [9] * 4, greedy(30))
        done = run(engine)
        assert [(done[s.id].finish_reason, len(done[s.id].token_ids)) for s in (a, b)] == [("length", 30)] * 2
        assert engine.totals["compressions"] >= 2
        assert_drained(engine)
    finally:
        engine.close()


def test_blocks_checked_for_a_compression_are_not_taken_by_decode_appends(model_path):
    """Sync compression: the scheduler checks that A's 2 fresh blocks are free, then, in the same
    step, C takes one of them for its next decode block. The compression must still find its blocks
    (or wait), not raise out of step()."""
    prefix = random_prompts(1, [32], seed=7)[0]
    engine = make_engine(model_path, async_compress=False, num_kv_blocks=11, max_cache_blocks_per_seq=3)
    try:
        a = engine.add_request(prefix + [5] * 4, greedy(40))  # 36 tokens: trigger (64) after 28 tokens
        engine.step()
        b = engine.add_request(prefix + [9], greedy(40))  # shares A's two prefix blocks
        c = engine.add_request(random_prompts(1, [20], seed=3)[0], greedy(40))  # needs a block at kv 48
        done = run(engine)
        assert all(done[s.id].finish_reason == "length" for s in (a, b, c))
        assert_drained(engine)
    finally:
        engine.close()


def test_sink_tokens_that_leave_no_room_for_the_window_are_rejected(model_path):
    """The window is always kept and the sinks are kept too: with a budget of 2 blocks of 16 and a
    window of 4, 40 sink tokens cannot all be honoured. Such a config must raise ValueError naming
    num_sink_tokens rather than silently drop kept tokens."""
    with pytest.raises(ValueError, match="num_sink_tokens"):
        make_engine(model_path, num_sink_tokens=40, window=4, max_cache_blocks_per_seq=2)
    with pytest.raises(ValueError, match="recent_share=0.9"):
        make_engine(model_path, recent_share=0.9, num_sink_tokens=8, window=4, max_cache_blocks_per_seq=2)


# ------------------------------------------------------------------------------------------
# 7. Compressed requests are never preempted


@pytest.mark.parametrize("async_compress", [False, True])
def test_compressed_requests_are_never_preempted(model_path, async_compress):
    engine = make_engine(model_path, num_kv_blocks=10, max_cache_blocks_per_seq=2, window=4,
                         async_compress=async_compress, num_query_slots=2)
    scheduler = engine.scheduler
    inner = scheduler._preempt
    preempted = []  # (request id, times_compressed, status, any compressed request live)

    def spy(seq, plan):
        assert not seq.is_compressed and seq.status is Status.RUNNING, (seq, seq.status)
        live_compressed = any(s.is_compressed for s in scheduler.running if s is not seq)
        preempted.append((seq.id, seq.times_compressed, seq.status, live_compressed))
        return inner(seq, plan)

    scheduler._preempt = spy
    try:
        # Two prompts longer than the budget are compressed at once and hold 3 of the 10 blocks each
        # for 70 tokens; the four others compete for the remaining blocks.
        prompts = random_prompts(6, [45, 40, 20, 8, 30, 14], seed=31)
        seqs = [engine.add_request(p, greedy(70)) for p in prompts]
        done = run(engine)
        assert_drained(engine)
    finally:
        engine.close()
    assert engine.totals["preemptions"] > 0
    assert engine.totals["compressions"] > 0
    assert len(preempted) == engine.totals["preemptions"]
    assert any(p[3] for p in preempted), "no preemption happened while a compressed request was running"
    events = [ev for ev in engine.events if ev.kind == "preempted"]
    assert [ev.request for ev in events] == [p[0] for p in preempted]
    assert all(p[1] == 0 for p in preempted)
    assert all(done[s.id].finish_reason == "length" and len(done[s.id].token_ids) == 70 for s in seqs)
    # A request that was compressed never shows up in a later preemption.
    compressed_at = {}
    for i, ev in enumerate(engine.events):
        if ev.kind == "compressed":
            compressed_at.setdefault(ev.request, i)
        if ev.kind == "preempted":
            assert ev.request not in compressed_at or compressed_at[ev.request] > i


@pytest.mark.parametrize("hold_compression", [False, True])
def test_victim_search_skips_compressed_and_compressing_requests(model_path, hold_compression):
    """U1 and U2 run uncompressed; L (a prompt longer than the budget) is admitted behind them, at the
    back of the running queue, where the victim search starts. When the pool runs dry, L must be
    skipped: compressed (its compression landed), or under compression (held in flight here)."""
    engine = make_engine(model_path, num_kv_blocks=7, max_cache_blocks_per_seq=2, window=4, num_query_slots=3,
                         async_compress=hold_compression)
    gate = threading.Event()
    spy = ExecuteSpy(engine, gate=gate if hold_compression else None)
    safety = threading.Timer(10.0, gate.set)  # never let a broken engine hang the suite
    safety.start()
    scheduler = engine.scheduler
    inner = scheduler._preempt
    victims = []

    def preempt(seq, plan):
        victims.append((seq.id, seq.times_compressed, seq.status, [s.id for s in scheduler.running]))
        return inner(seq, plan)

    scheduler._preempt = preempt
    try:
        u1_prompt, u2_prompt, l_prompt = random_prompts(3, [17, 5, 50], seed=31)
        u1, u2 = engine.add_request(u1_prompt, greedy(60)), engine.add_request(u2_prompt, greedy(60))
        engine.step()
        long_seq = engine.add_request(l_prompt, greedy(60))
        done = {}
        steps = 0
        while engine.has_work():
            steps += 1
            assert steps < 2000
            if victims or steps > 40:
                gate.set()
            for out in engine.step():
                if out.finished:
                    done[out.id] = out
            check_step(engine)
        assert_drained(engine)
    finally:
        gate.set()
        safety.cancel()
        engine.close()
    assert victims, "the pool never ran dry: the scenario did not test the victim search"
    first = victims[0]
    assert first[3][-1] == long_seq.id, "L should have been at the back of the running queue"
    assert first[0] != long_seq.id, f"L was preempted ({first[2]}, compressed {first[1]}x)"
    assert all(v[1] == 0 and v[2] is Status.RUNNING for v in victims)
    assert [(done[s.id].finish_reason, len(done[s.id].token_ids)) for s in (u1, u2, long_seq)] == [("length", 60)] * 3
    assert spy.records and done[long_seq.id].metrics["preemptions"] == 0


# ------------------------------------------------------------------------------------------
# 8. Async and sync compression agree; every scoring switch runs clean


def _workload(seed=41):
    prompts = random_prompts(4, [5, 30, 50, 12], seed=seed)  # 50 > the 32-token budget
    return prompts, [90, 80, 60, 100]


def test_async_and_sync_compression_give_the_same_tokens(model_path):
    prompts, max_tokens = _workload()
    sync, sync_totals = generate(model_path, prompts, max_tokens, async_compress=False)
    asyn, async_totals = generate(model_path, prompts, max_tokens, async_compress=True)
    assert sync_totals["compressions"] >= 4 * 3
    assert async_totals["compressions"] == sync_totals["compressions"]
    assert varied(sync)
    assert asyn == sync
    # Compression really changed something (otherwise the comparison above proves little).
    full, _ = generate(model_path, prompts, max_tokens, compression=False)
    assert full != sync


SWITCHES = list(itertools.product([False, True], repeat=4))


@pytest.mark.parametrize("use_global_score,use_redundancy,lightning_redundancy,enable_pooling", SWITCHES)
def test_every_scoring_switch_combination(model_path, use_global_score, use_redundancy, lightning_redundancy,
                                          enable_pooling):
    prompts, max_tokens = _workload(seed=43)
    knobs = dict(use_global_score=use_global_score, use_redundancy=use_redundancy,
                 lightning_redundancy=lightning_redundancy, enable_pooling=enable_pooling, num_kv_blocks=24)
    sync, totals = generate(model_path, prompts, max_tokens, async_compress=False, **knobs)
    assert totals["compressions"] >= 12
    assert [len(t) for t in sync] == max_tokens
    asyn, _ = generate(model_path, prompts, max_tokens, async_compress=True, **knobs)
    assert asyn == sync


class KernelTrace:
    """Records every compression-kernel call the compressor makes (arguments and result)."""

    NAMES = ("window_attention_score", "pool_scores", "global_score_merge", "redundancy_score", "keep_indices",
             "compact_kv")

    def __init__(self, monkeypatch):
        from zipage import kernels

        self.calls = []
        for name in self.NAMES:
            inner = getattr(kernels, name)

            def wrapper(*args, _name=name, _inner=inner, **scales):  # an fp8 cache's scales, by keyword
                snapshot = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                result = _inner(*args, **scales)
                self.calls.append((_name, snapshot, result.clone() if isinstance(result, torch.Tensor) else None))
                return result

            monkeypatch.setattr(kernels, name, wrapper)


@pytest.mark.parametrize("lightning", [True, False])
def test_scoring_pipeline_follows_the_design(model_path, monkeypatch, lightning):
    """Per layer: window score -> max-pooling (first compression only, kernel 5) -> global merge with
    the score the kept tokens carried (none on the first compression) -> final = lambda*s - (1-lambda)*
    redundancy (lightning: within blocks of b) with the newest entries (the recent share of the budget,
    window included) forced in -> top n*b -> compaction that
    carries s (not the final score) in the score cache."""
    cfg = dict(async_compress=False, window=4, max_cache_blocks_per_seq=2, lightning_redundancy=lightning,
               redundancy_lambda=0.3, redundancy_temperature=0.5, global_decay=0.7, pooling_kernel=5)
    engine = make_engine(model_path, **cfg)
    trace = KernelTrace(monkeypatch)
    spy = ExecuteSpy(engine)
    bs, w, keep, layers = 16, 4, 32, engine.runner.num_layers
    recent = int(0.75 * keep)  # the default recent share of the 32-entry budget
    assert engine.compressor.protected(0, True)[1] == recent
    prompts = random_prompts(2, [10, 60], seed=71)
    for p in prompts:
        engine.add_request(p, greedy(45))
    run(engine)
    assert_drained(engine)
    engine.close()
    jobs = [r[0] for r in spy.records]
    protected = {id(r[0]): r[4] for r in spy.records}
    # The 10-token prompt fits in half the budget and stays, the recent share takes 3/4 of the rest; the
    # 60-token prompt is compressed after its prefill with only its window forced in, then decodes.
    assert {(10, 16), (0, w), (0, recent)} <= set(protected.values())
    assert len(jobs) >= 4 and any(j.first for j in jobs) and any(not j.first for j in jobs)
    calls = iter(trace.calls)
    for job in jobs:
        for _layer in range(layers):
            name, args, score = next(calls)
            assert name == "window_attention_score" and args[3] == job.kv_len
            assert args[0].shape[0] == w
            if job.first:
                name, args, pooled = next(calls)
                assert name == "pool_scores" and args[1] == 5 and torch.equal(args[0], score)
                score = pooled
            name, args, merged = next(calls)
            assert name == "global_score_merge" and torch.equal(args[0], score)
            assert args[2] == (0 if job.first else keep) and args[3] == 0.7
            name, args, redundancy = next(calls)
            assert name == "redundancy_score" and args[1] == (bs if lightning else None)
            assert args[2] == 0.5 and args[3] == 0.5 and args[0].shape[1] == job.kv_len
            name, args, kept = next(calls)
            assert name == "keep_indices" and args[1] == keep
            final = args[0]
            want = 0.3 * merged - 0.7 * redundancy
            lead, recent = protected[id(job)]  # a short prompt, and the newest entries, are forced in
            newest = job.kv_len - recent
            assert torch.isinf(final[:, newest:]).all() and torch.isinf(final[:, :lead]).all()
            torch.testing.assert_close(final[:, lead:newest], want[:, lead:newest])
            name, args, _ = next(calls)
            assert name == "compact_kv"
            assert torch.equal(args[5], merged.gather(1, kept)), "the score cache must carry s, not the final score"
            assert args[4].tolist() == [b * bs + o for b in job.targets for o in range(bs)]
    assert next(calls, None) is None


@pytest.mark.parametrize("eviction", ["random", "recent"])
@pytest.mark.parametrize("async_compress", [False, True])
def test_baseline_eviction_policies_run_clean(model_path, eviction, async_compress):
    prompts, max_tokens = _workload(seed=47)
    tokens, totals = generate(model_path, prompts, max_tokens, eviction=eviction, async_compress=async_compress,
                              num_kv_blocks=16, num_sink_tokens=2)
    assert totals["compressions"] >= 12
    assert [len(t) for t in tokens] == max_tokens


def test_scoring_switches_change_what_is_kept(model_path):
    """The switches are wired: different policies keep different tokens (so different outputs)."""
    prompts, max_tokens = _workload(seed=43)
    outs = {}
    for name, knobs in {"score": {}, "no-redundancy": dict(use_redundancy=False),
                        "recent": dict(eviction="recent")}.items():
        outs[name], _ = generate(model_path, prompts, max_tokens, async_compress=False, **knobs)
    assert outs["score"] != outs["no-redundancy"]
    assert outs["score"] != outs["recent"]


# ------------------------------------------------------------------------------------------
# 9. Aborting a request whose compression is in flight


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_abort_while_compression_in_flight_frees_every_block(model_path, shared_prefix):
    """The victim's prompt is longer than the budget, so it is compressed right after its prefill;
    its compression is held inside execute (a gate) while it is aborted. With a shared prefix, the
    job has also reserved fresh blocks (it may not write the shared ones)."""
    n, bs = 4, 16
    engine = make_engine(model_path, async_compress=True, num_kv_blocks=40, max_cache_blocks_per_seq=n, window=4,
                         prefix_caching=shared_prefix)
    gate = threading.Event()
    spy = ExecuteSpy(engine, gate=gate)
    prefix = random_prompts(1, [3 * bs], seed=50)[0]
    victim_prompt, *others = random_prompts(3, [88, 10, 20], seed=51)  # 88 > trigger (80): 6 blocks
    if shared_prefix:
        others[0] = prefix + others[0]  # a holder of the prefix, submitted first: 58 tokens, uncompressed
        victim_prompt = prefix + victim_prompt[3 * bs:]
    rest = [engine.add_request(others[0], greedy(80))]
    engine.step()
    victim = engine.add_request(victim_prompt, greedy(50))
    rest.append(engine.add_request(others[1], greedy(80)))
    steps = 0
    while victim.id not in engine.jobs:
        engine.step()
        check_step(engine)
        steps += 1
        assert steps < 50
    # The worker thread enters execute on its own schedule, not within a number of engine steps.
    assert spy.started.wait(timeout=30), "the victim's compression never started"
    job = engine.jobs[victim.id]
    assert job.seq is victim and victim.status is Status.COMPRESSING
    shared = set(victim.block_table[:3]) if shared_prefix else set()
    if shared_prefix:
        assert victim.num_cached_prefix_tokens == 3 * bs
        assert all(engine.blocks.blocks[x].ref_count == 2 for x in shared)
        # n + 1 = 5 new blocks: its private block that the prefix cache does not map (the last, partly
        # filled one) and 4 fresh ones; the pool has room, so its cached prompt blocks are spared.
        assert len(victim.pending_blocks) == 4
    held = set(victim.block_table) | set(victim.pending_blocks)
    assert set(job.source_table) <= held and set(job.targets + [job.decode_block]) <= held
    assert len(victim.block_table) == 6 and job.release
    # The others keep decoding while the victim's compression hangs.
    before = [s.num_output_tokens for s in rest]
    for _ in range(5):
        engine.step()
        check_step(engine)
    assert all(s.num_output_tokens > b for s, b in zip(rest, before))
    assert victim.num_output_tokens == 1 and victim.id in engine.jobs
    # Abort it while the worker is still inside execute; the gate opens a little later.
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    out = engine.abort(victim.id)
    opener.join()
    assert out is not None and out.finish_reason == "abort"
    assert victim.id not in engine.jobs and victim.id not in engine.requests
    assert not victim.block_table and not victim.pending_blocks
    free = set(engine.blocks.free_ids)
    assert held - shared <= free, f"blocks {sorted(held - shared - free)} of the aborted request are still held"
    assert all(engine.blocks.blocks[b].ref_count == 0 for b in held - shared)
    assert all(engine.blocks.blocks[b].ref_count == 1 for b in shared)  # the holder's reference only
    engine.check_invariants()
    check_step(engine)
    assert not spy.records[0][3], "the aborted request's blocks were freed while the worker wrote them"
    done = run(engine)
    assert all(done[s.id].finish_reason == "length" and len(done[s.id].token_ids) == 80 for s in rest)
    assert engine.totals["compressions"] >= 2  # the others were compressed afterwards
    assert not any(ev.kind == "compressed" and ev.request == victim.id for ev in engine.events)
    assert_drained(engine)
    engine.close()


def test_abort_of_a_landed_but_unapplied_compression(model_path):
    """A job whose tensor work is done but which has not landed yet: abort frees the old table and
    the fresh blocks, and the job never lands afterwards."""
    engine = make_engine(model_path, async_compress=True, num_kv_blocks=40)
    spy = ExecuteSpy(engine)
    victim = engine.add_request(random_prompts(1, [70], seed=52)[0], greedy(30))
    other = engine.add_request(random_prompts(1, [5], seed=53)[0], greedy(30))
    while victim.id not in engine.jobs:
        engine.step()
    job = engine.jobs[victim.id]
    job.future.result(timeout=30)  # done, not applied
    held = set(victim.block_table) | set(victim.pending_blocks)
    engine.abort(victim.id)
    assert held <= set(engine.blocks.free_ids)
    done = run(engine)
    assert done[other.id].finish_reason == "length"
    assert_drained(engine)
    assert len(spy.records) >= 1
    engine.close()


# ------------------------------------------------------------------------------------------
# 10. Snapshots and events


def test_snapshot_roles_slots_and_compressed_events(model_path):
    n, bs, w = 3, 16, 4
    engine = make_engine(model_path, max_cache_blocks_per_seq=n, window=w, num_kv_blocks=40, num_query_slots=2,
                         async_compress=False)
    long_prompt, *short = random_prompts(3, [90, 10, 20], seed=61)
    seqs = [engine.add_request(p, greedy(80)) for p in [long_prompt] + short]
    seen_roles = set()
    long_first_step = {}

    def observe(e):
        snap = e.snapshot()
        live_slots = [r.query_slot for r in snap.requests if r.query_slot is not None]
        assert snap.pool.query_slots_used == len(live_slots) <= snap.pool.query_slots_total == 2
        for r in snap.requests:
            assert len(r.block_roles) == len(r.block_table)
            if r.times_compressed:
                assert r.block_roles == ("target",) * n + ("decode",)
                assert len(r.block_table) == n + 1
                assert r.kv_len <= (n + 1) * bs
                seen_roles.add(r.id)
            if r.id == seqs[0].id and r.output_tokens <= 2:
                long_first_step[r.output_tokens] = r.times_compressed

    run(engine, on_step=observe)
    assert seen_roles == {s.id for s in seqs}
    # The 90-token prompt (6 blocks) was compressed to the budget before its first decode step.
    assert long_first_step.get(2) == 1
    events = [ev for ev in engine.events if ev.kind == "compressed"]
    assert len(events) == engine.totals["compressions"] > 0
    for ev in events:
        d = ev.details
        assert {"blocks_before", "blocks_after", "evicted_per_layer", "seconds"} <= set(d)
        assert d["blocks_after"] == n + 1
        assert d["blocks_before"] >= n + 1
        assert d["tokens_after"] == n * bs
        assert d["evicted_per_layer"] == d["tokens_before"] - n * bs > 0
        assert d["blocks_before"] == -(-d["tokens_before"] // bs)
        assert isinstance(d["seconds"], float) and d["seconds"] >= 0
    first_long = next(ev for ev in events if ev.request == seqs[0].id)
    assert first_long.details["tokens_before"] == 90 and first_long.details["blocks_before"] == 6
    assert first_long.details["evicted_per_layer"] == 90 - n * bs
    later = [ev for ev in events if ev.details["times"] > 1]
    assert later and all(ev.details["tokens_before"] == (n + 1) * bs for ev in later)
    assert_drained(engine)
    engine.close()


@pytest.mark.parametrize("extra_tokens", [1, 20])  # inside the (n+1)-th block, and past N_max blocks
def test_prompt_longer_than_the_budget_is_compressed_before_its_first_decode(model_path, extra_tokens):
    engine = make_engine(model_path, async_compress=False)
    budget = engine.config.max_cache_blocks_per_seq * engine.block_size
    prompt = random_prompts(1, [budget + extra_tokens], seed=21)[0]
    seq = engine.add_request(prompt, greedy(8))
    engine.step()  # prefill: samples the first token from the full prompt
    assert seq.num_output_tokens == 1 and not seq.is_compressed
    engine.step()  # the compression lands before any decode
    assert seq.is_compressed and seq.kv_len == budget and seq.num_output_tokens == 1
    assert len(seq.block_table) == engine.config.max_cache_blocks_per_seq + 1
    run(engine)
    assert_drained(engine)
    engine.close()
