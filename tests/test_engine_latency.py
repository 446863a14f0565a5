"""The latency monitor: percentiles, windows, rates and the stall flag under a hand-driven clock,
then the figures a real engine run puts into its snapshot."""

from __future__ import annotations

import pytest

from zipage.engine import LLM
from zipage.engine.config import SamplingParams
from zipage.engine.latency import STALL_S, LatencyMonitor


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def window(latency, seconds: float):
    return next(w for w in latency.windows if w.seconds == seconds)


def test_percentiles_of_inter_token_gaps_within_bucket_accuracy():
    clock = Clock()
    monitor = LatencyMonitor(clock)
    clock.now += 0.5
    monitor.token(1, arrival=clock.now - 0.25)  # first token: TTFT 0.25 s
    gaps = [0.010] * 90 + [0.100] * 9 + [1.0]  # 100 gaps
    for gap in gaps:
        clock.now += gap
        monitor.token(1, arrival=0.0)
    summary = monitor.summary(has_work=True)
    last5 = window(summary, 5.0)
    assert last5.ttft.count == 1 and last5.ttft.p50 == pytest.approx(0.25, rel=0.05)
    assert last5.itl.count == 100
    assert last5.itl.p50 == pytest.approx(0.010, rel=0.05)
    assert last5.itl.p95 == pytest.approx(0.100, rel=0.05)
    assert last5.itl.p99 == pytest.approx(0.100, rel=0.05)  # rank 99 of 100 is still a 0.1 s gap
    assert last5.queue.count == 0 and last5.queue.p50 is None


def test_windows_forget_old_samples_and_rates_count_per_second():
    clock = Clock()
    monitor = LatencyMonitor(clock)
    for _ in range(6):  # six preemptions and three compressions early on
        monitor.count("preemptions")
    for _ in range(3):
        monitor.count("compressions")
    monitor.admitted(arrival=clock.now - 2.0, prompt_tokens=100, cached_tokens=0, first_time=True)
    clock.now += 30.0
    monitor.admitted(arrival=clock.now - 0.5, prompt_tokens=100, cached_tokens=75, first_time=True)
    monitor.admitted(arrival=clock.now - 9.0, prompt_tokens=100, cached_tokens=25, first_time=False)
    monitor.count("aborts")
    summary = monitor.summary(has_work=False)
    last5, last60 = window(summary, 5.0), window(summary, 60.0)
    assert last5.queue.count == 1 and last5.queue.p50 == pytest.approx(0.5, rel=0.05)  # a re-admission is no queue time
    assert last60.queue.count == 2 and last60.queue.p99 == pytest.approx(2.0, rel=0.05)
    assert last5.prefix_hit_rate == pytest.approx(100 / 200)
    assert last60.prefix_hit_rate == pytest.approx(100 / 300)
    assert last5.preemptions_per_s == 0 and last5.aborts_per_s == pytest.approx(1 / 5)
    assert last60.preemptions_per_s == pytest.approx(6 / 30)  # the engine is 30 s old: a rate over 30 s
    assert last60.compressions_per_s == pytest.approx(3 / 30)
    clock.now += 120.0
    summary = monitor.summary(has_work=False)
    assert all(w.queue.count == 0 and w.prefix_hit_rate is None and w.aborts_per_s == 0 for w in summary.windows)


def test_stall_flag_needs_pending_work_and_no_step():
    clock = Clock()
    monitor = LatencyMonitor(clock)
    clock.now += 100.0
    assert not monitor.summary(has_work=False).stalled  # idle is not stalled
    monitor.arrived()
    assert not monitor.summary(has_work=True).stalled  # just arrived: not stalled yet
    clock.now += STALL_S + 0.1
    assert monitor.summary(has_work=True).stalled
    monitor.stepped()
    summary = monitor.summary(has_work=True)
    assert not summary.stalled and summary.since_last_step == 0.0


def run_twice(**knobs):
    """Two prompts sharing 40 tokens, then a third sharing them too; the last snapshot's latency."""
    llm = LLM("random:llama-tiny", device="cpu", block_size=16, window=8, num_kv_blocks=64, **knobs)
    try:
        shared = list(range(10, 50))  # 40 tokens: two full blocks the second round can find cached
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        llm.generate([shared + [1], shared + [2]], params)
        llm.generate([shared + [3]], params)
        return llm.snapshot().latency
    finally:
        llm.close()


def test_a_real_run_fills_the_snapshot():
    summary = run_twice(max_cache_blocks_per_seq=1)
    last60 = window(summary, 60.0)
    assert last60.ttft.count == 3 and last60.queue.count == 3
    assert last60.itl.count == 3 * 29
    assert last60.ttft.p50 > 0 and last60.itl.p99 >= last60.itl.p50 > 0
    assert last60.compressions_per_s > 0  # 71 tokens against a 1-block budget of 16
    assert last60.preemptions_per_s == 0 and last60.aborts_per_s == 0
    assert not summary.stalled and summary.since_last_step is not None


def test_prefix_hits_show_in_the_hit_rate():
    last60 = window(run_twice(compression=False), 60.0)
    # 3 prompts of 41 tokens; the third finds the 2 shared blocks (32 tokens) in the cache
    assert last60.prefix_hit_rate == pytest.approx(32 / 123)


def test_the_latency_pane_flags_a_stall_from_the_flag_or_an_old_snapshot():
    import dataclasses

    from zipage.cli.console.widgets import LatencyView
    from zipage.engine.events import Latency

    llm = LLM("random:llama-tiny", device="cpu", block_size=16, window=8, num_kv_blocks=64)
    try:
        llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
        snapshot = llm.snapshot()  # work waiting, nothing stepped yet
    finally:
        llm.close()
    view = LatencyView()
    view.show(snapshot)
    assert view.stall_note(now=snapshot.time + 1.0) is None
    assert view.stall_note(now=snapshot.time + STALL_S + 2.0) == f"STALLED: no news from the engine for {STALL_S + 2:.0f} s"
    view.show(dataclasses.replace(snapshot, latency=Latency(stalled=True, since_last_step=9.0)))
    assert view.stall_note(now=snapshot.time) == "STALLED: work waits, no step for 9 s"
    view.show(dataclasses.replace(snapshot, waiting=0, running=0))
    assert view.stall_note(now=snapshot.time + 100.0) is None  # an idle engine is not stalled
