"""Overlapped decode: planning step N+1 before step N's tokens are read changes nothing a request
sees. Each test serves the same requests with `overlap_steps` off and on (the CPU runs the same
code path as CUDA, only synchronously) and compares tokens, text, finish reasons and totals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from compression_helpers import build_random_model, check_step, greedy, make_engine, random_prompts, run, assert_drained
from zipage.engine import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_random_model(tmp_path_factory.mktemp("zipage-overlap"), "qwen3-tiny", seed=5)


def serve(path, requests, overlap: bool, **knobs):
    """Outputs (by submission order) of (prompt, params) requests served together, the engine's
    totals and how many steps were overlapped; the invariants hold after every step."""
    engine = make_engine(path, overlap_steps=overlap, **knobs)
    try:
        seqs = [engine.add_request(prompt, params, stream=stream) for prompt, params, stream in requests]
        done = run(engine)
        assert_drained(engine)
        return [done[s.id] for s in seqs], dict(engine.totals), engine.overlapped_steps
    finally:
        engine.close()


# Counters that depend on the schedule: with overlap, the blocks of a request that ends in step N are
# freed when step N is read, after step N+1 was planned, so a waiting request may be admitted a step
# later; and a compression may start for a request whose token in flight turns out to be its last
# (a compaction that lands at once, without the worker, is then counted).
SCHEDULE_COUNTERS = ("preemptions", "prefix_hit_tokens", "compressions")


def same_outputs(path, requests, same_schedule: bool = True, **knobs):
    plain, plain_totals, none = serve(path, requests, overlap=False, **knobs)
    overlapped, totals, count = serve(path, requests, overlap=True, **knobs)
    assert none == 0
    for a, b in zip(plain, overlapped):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert (b.finish_reason, b.num_output_tokens) == (a.finish_reason, a.num_output_tokens)
        assert -1 not in b.token_ids
    if not same_schedule:
        for key in SCHEDULE_COUNTERS:
            totals.pop(key), plain_totals.pop(key)
    assert totals == plain_totals
    return overlapped, count


@pytest.mark.parametrize("compression", [False, True])
def test_most_decode_steps_overlap_and_outputs_match(model_path, compression):
    prompts = random_prompts(4, [7, 20, 33, 50], seed=1)
    requests = [(p, greedy(m), False) for p, m in zip(prompts, [40, 60, 17, 80])]
    outputs, overlapped = same_outputs(model_path, requests, compression=compression)
    assert [o.num_output_tokens for o in outputs] == [40, 60, 17, 80]
    # 80 decode steps in all; only the steps around admissions, compressions and the end are not overlapped
    assert overlapped >= (40 if compression else 60)


def test_early_stops_sampling_and_streams_match(model_path):
    """Requests that stop on a token id, on a stop string or by length, sampled with a seed or from
    the engine's seed, streamed or not: the token after a stop is computed but never reported."""
    prompts = random_prompts(5, [9, 15, 22, 30, 12], seed=2)
    reference, _, _ = serve(model_path, [(prompts[0], greedy(30), False)], overlap=False)
    stop_id = reference[0].token_ids[11]
    stop_text = reference[0].text[len(reference[0].text) // 2:][:3]
    requests = [
        (prompts[0], greedy(30, stop_token_ids=[stop_id]), True),
        (prompts[1], greedy(25, stop=[stop_text] if stop_text.strip() else None), True),
        (prompts[2], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=28, seed=7, ignore_eos=True), True),
        (prompts[3], SamplingParams(temperature=1.0, top_k=20, max_tokens=33, ignore_eos=True), False),
        (prompts[4], greedy(1), True),
    ]
    outputs, overlapped = same_outputs(model_path, requests)
    assert outputs[0].finish_reason == "stop" and outputs[0].num_output_tokens <= 12
    assert overlapped > 10


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5)],
                         ids=["repetition", "frequency and presence"])
def test_a_penalty_is_served_synchronously_beside_overlapped_requests(model_path, penalty):
    prompts = random_prompts(3, [10, 18, 25], seed=3)
    requests = [(prompts[0], greedy(30, **penalty), False),
                (prompts[1], greedy(30), False), (prompts[2], greedy(45), False)]
    _, overlapped = same_outputs(model_path, requests)
    assert overlapped >= 10  # once the penalised request is done, the others overlap


def watch_compression_starts(engine) -> list[tuple[bool, int, int]]:
    """For each compression the engine starts: whether a step was in flight, the request, and its
    output tokens counted then (its token in flight included)."""
    starts = []
    start = engine._start_compression

    def recording(job):
        starts.append((engine.inflight is not None, job.seq.id, job.seq.num_output_tokens))
        return start(job)

    engine._start_compression = recording
    return starts


@pytest.mark.parametrize("async_compress", [False, True])
def test_compressions_start_while_a_step_is_in_flight(model_path, async_compress):
    """A compression is planned from lengths alone, so the step that starts it overlaps too, and what
    each request gets is unchanged."""
    prompts = random_prompts(4, [7, 20, 33, 50], seed=1)
    requests = [(p, greedy(m), False) for p, m in zip(prompts, [40, 60, 17, 80])]
    same_outputs(model_path, requests, same_schedule=async_compress, async_compress=async_compress)
    engine = make_engine(model_path, overlap_steps=True, async_compress=async_compress)
    try:
        starts = watch_compression_starts(engine)
        for prompt, params, _ in requests:
            engine.add_request(prompt, params)
        run(engine)
        assert_drained(engine)
        assert sum(in_flight for in_flight, *_ in starts) >= 3
    finally:
        engine.close()


def test_a_request_that_ends_while_its_compression_runs(model_path):
    """A compression started while the request's token was in flight, and that token is its last:
    the compaction is waited for and dropped, the request ends as it would have without overlap, and
    every block comes back."""
    prompt, partner = random_prompts(2, [12, 9], seed=11)  # the partner decodes beside the compression
    probe = make_engine(model_path, overlap_steps=True)
    try:
        starts = watch_compression_starts(probe)
        first = probe.add_request(prompt, greedy(60))
        probe.add_request(partner, greedy(60))
        run(probe)
        in_flight, last = next((f, n) for f, request, n in starts if request == first.id)
        assert in_flight
    finally:
        probe.close()
    requests = [(prompt, greedy(last), False), (partner, greedy(60), False)]
    same_outputs(model_path, requests)
    engine = make_engine(model_path, overlap_steps=True)
    try:
        starts = watch_compression_starts(engine)
        seqs = [engine.add_request(p, params) for p, params, _ in requests]
        done = run(engine)
        ended = done[seqs[0].id]
        assert ended.num_output_tokens == last and ended.metrics["times_compressed"] == 0
        assert (True, seqs[0].id, last) in starts  # its compression started, and never landed
        assert_drained(engine)
    finally:
        engine.close()


def test_model_length_limit(model_path):
    prompts = random_prompts(2, [20, 30], seed=4)
    requests = [(p, greedy(100), False) for p in prompts]
    outputs, _ = same_outputs(model_path, requests, max_model_len=48, compression=False)
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert [o.num_output_tokens for o in outputs] == [28, 18]


def test_abort_while_a_step_is_in_flight(model_path):
    """A request aborted while its next token is still on the device ends with the tokens it had
    reported; the others are unaffected and every block comes back."""
    prompts = random_prompts(3, [12, 16, 20], seed=6)
    reference, _, _ = serve(model_path, [(p, greedy(40), False) for p in prompts], overlap=False)
    engine = make_engine(model_path, overlap_steps=True)
    try:
        seqs = [engine.add_request(p, greedy(40)) for p in prompts]
        for _ in range(100):  # bounded: a broken engine fails here instead of looping
            if engine.overlapped_steps >= 5 or not engine.has_work():
                break
            engine.step()
            check_step(engine)
        assert engine.inflight is not None and seqs[1] in engine.inflight.batch.seqs
        reported = seqs[1].num_output_tokens
        aborted = engine.abort(seqs[1].id)
        assert aborted.finish_reason == "abort" and -1 not in aborted.token_ids
        assert aborted.token_ids == reference[1].token_ids[:reported]
        done = run(engine)
        assert done[seqs[0].id].token_ids == reference[0].token_ids
        assert done[seqs[2].id].token_ids == reference[2].token_ids
        assert seqs[1].id not in done
        assert_drained(engine)
    finally:
        engine.close()


@settings(max_examples=40, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4), chunk=st.integers(1, 80),
       pool=st.integers(8, 40), max_tokens=st.lists(st.integers(1, 50), min_size=4, max_size=4),
       compression=st.booleans(), seed=st.integers(0, 10_000))
def test_outputs_never_depend_on_overlap(model_path, lengths, chunk, pool, max_tokens, compression, seed):
    """Any mix of prompt lengths, chunked prefill, tight pools (preemption) and compression. A request
    waiting for room may be admitted a step later with overlap, so the schedule may differ; what
    each request gets may not."""
    prompts = random_prompts(len(lengths), lengths, seed=seed)
    pool = max(pool, -(-max(lengths) // 16) + 2)
    requests = [(p, greedy(m), False) for p, m in zip(prompts, max_tokens)]
    same_outputs(model_path, requests, same_schedule=False, num_kv_blocks=pool, max_num_batched_tokens=chunk,
                 compression=compression)


def test_steps_overlap_while_requests_wait_for_room(model_path):
    """Requests that cannot be admitted yet (every running place taken) do not stop the running
    ones from overlapping; each is admitted as soon as a place frees up."""
    prompts = random_prompts(5, [8, 14, 21, 9, 30], seed=8)
    requests = [(p, greedy(m), False) for p, m in zip(prompts, [30, 12, 25, 18, 20])]
    outputs, overlapped = same_outputs(model_path, requests, max_num_seqs=2)
    assert [o.num_output_tokens for o in outputs] == [30, 12, 25, 18, 20]
    assert overlapped >= 40


def test_an_idle_engine_holds_no_step(model_path):
    """The step queued after every request's last token is dropped once they have all ended, and an
    abort of the last running request drops the step it was in: an idle engine has no work."""
    engine = make_engine(model_path, overlap_steps=True)
    try:
        prompts = random_prompts(2, [10, 15], seed=9)
        for p in prompts:
            engine.add_request(p, greedy(12))
        done = run(engine)
        assert len(done) == 2 and engine.inflight is None and not engine.has_work()
        seq = engine.add_request(prompts[0], greedy(40))
        for _ in range(100):
            if engine.inflight is not None and engine.overlapped_steps > 3:
                break
            engine.step()
        assert engine.inflight is not None
        engine.abort(seq.id)
        assert engine.inflight is None and not engine.has_work()
        assert_drained(engine)
    finally:
        engine.close()


def test_a_step_by_hand_shows_its_tokens(model_path):
    """Teaching mode pauses the engine thread and steps it by hand: each decode step's token is read
    before the step returns, so every step shows exactly one more token per request."""
    from zipage.engine.api.thread import EngineThread

    service = EngineThread(model_path, **dict(make_knobs(), overlap_steps=True))
    try:
        service.pause()
        handles = [service.submit(p, greedy(6)) for p in random_prompts(2, [9, 12], seed=10)]
        service.step_once()  # the prefill: each request's first token
        for expected in range(2, 6):
            assert [r.output_tokens for r in service.step_once().requests] == [expected] * 2
        assert service.step_once().requests == ()  # the sixth token ends both
        service.resume()
        assert all(h.result(timeout=60).num_output_tokens == 6 for h in handles)
    finally:
        service.close()


def make_knobs() -> dict:
    from compression_helpers import SMALL_BUDGET

    return dict(SMALL_BUDGET, num_kv_blocks=128)
