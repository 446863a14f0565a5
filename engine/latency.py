"""Latency as users feel it, over sliding windows: time to first token, inter-token latency and
queue time as p50/p95/p99, prefix-cache hit rate, preemptions, aborts and compressions per second,
and a stall flag.

Samples go into log-spaced buckets per second of the clock, so a summary costs the same at
10 tokens/s as at 10,000: a window merges at most 60 slots of at most a few hundred buckets. A
percentile comes back as its bucket's geometric middle, within 4.5% of the true value.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Callable

from zipage.engine.events import Latency, LatencyWindow, Percentiles

WINDOWS_S = (5.0, 15.0, 60.0)
STALL_S = 5.0  # pending work and no finished step for this long is a stall
BUCKETS_PER_DOUBLING = 8  # bucket width 2^(1/8) = 9%: a reported percentile is within 4.5%
SMALLEST_S = 1e-6


def _bucket(seconds: float) -> int:
    return math.floor(math.log2(max(seconds, SMALLEST_S)) * BUCKETS_PER_DOUBLING)


def _middle(bucket: int) -> float:
    return 2.0 ** ((bucket + 0.5) / BUCKETS_PER_DOUBLING)


class _Series:
    """Timed samples of one quantity: a histogram per whole second of the clock, the last 60 s kept."""

    def __init__(self, keep_s: float):
        self.keep_s = keep_s
        self.slots: deque[tuple[int, Counter]] = deque()

    def add(self, now: float, bucket: int, weight: int = 1) -> None:
        second = math.floor(now)
        if not self.slots or self.slots[-1][0] != second:
            self.slots.append((second, Counter()))
        self.slots[-1][1][bucket] += weight
        while self.slots and self.slots[0][0] <= now - self.keep_s - 1:
            self.slots.popleft()

    def merged(self, now: float, window_s: float) -> Counter:
        total: Counter = Counter()
        for second, counts in self.slots:
            if second > now - window_s - 1 + 1e-9:  # the window's slots, the current partial one included
                total.update(counts)
        return total


def _percentiles(counts: Counter) -> Percentiles:
    n = sum(counts.values())
    if not n:
        return Percentiles()
    ordered = sorted(counts.items())
    values = []
    for p in (50, 95, 99):
        rank, seen = math.ceil(p / 100 * n), 0  # nearest rank
        for bucket, count in ordered:
            seen += count
            if seen >= rank:
                values.append(_middle(bucket))
                break
    return Percentiles(*values, count=n)


class LatencyMonitor:
    """Fed by the engine as requests move; summarised into the snapshot. `clock` is injectable so
    tests can drive time by hand."""

    COUNTERS = ("preemptions", "aborts", "compressions")

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        keep = max(WINDOWS_S)
        self.ttft, self.itl, self.queue = _Series(keep), _Series(keep), _Series(keep)
        self.prompt_tokens, self.cached_tokens = _Series(keep), _Series(keep)  # bucket 0: plain sums
        self.counters = {name: _Series(keep) for name in self.COUNTERS}
        self.last_token: dict[int, float] = {}  # request id -> when its latest token came
        self.last_step: float | None = None
        self.last_activity = self.started  # the latest step or arrival: a stall is counted from here

    def arrived(self) -> None:
        self.last_activity = self.clock()

    def admitted(self, arrival: float, prompt_tokens: int, cached_tokens: int, first_time: bool) -> None:
        """A request got its blocks. Queue time counts a request's first admission only: a preempted
        one waits again for reasons of its own, and its next token's gap shows that wait."""
        now = self.clock()
        if first_time:
            self.queue.add(now, _bucket(now - arrival))
        self.prompt_tokens.add(now, 0, prompt_tokens)
        self.cached_tokens.add(now, 0, cached_tokens)

    def token(self, request_id: int, arrival: float) -> None:
        """A request produced a token: its first gives the TTFT, every later one a gap."""
        now = self.clock()
        last = self.last_token.get(request_id)
        if last is None:
            self.ttft.add(now, _bucket(now - arrival))
        else:
            self.itl.add(now, _bucket(now - last))
        self.last_token[request_id] = now

    def count(self, what: str) -> None:
        self.counters[what].add(self.clock(), 0)

    def finished(self, request_id: int) -> None:
        self.last_token.pop(request_id, None)

    def stepped(self) -> None:
        self.last_step = self.last_activity = self.clock()

    def summary(self, has_work: bool) -> Latency:
        now = self.clock()
        windows = []
        for window in WINDOWS_S:
            span = max(min(window, now - self.started), 1e-9)  # a young engine has not seen a whole window
            prompt = sum(self.prompt_tokens.merged(now, window).values())
            cached = sum(self.cached_tokens.merged(now, window).values())
            rates = {name: sum(series.merged(now, window).values()) / span for name, series in self.counters.items()}
            windows.append(LatencyWindow(
                seconds=window, ttft=_percentiles(self.ttft.merged(now, window)),
                itl=_percentiles(self.itl.merged(now, window)), queue=_percentiles(self.queue.merged(now, window)),
                prefix_hit_rate=cached / prompt if prompt else None, preemptions_per_s=rates["preemptions"],
                aborts_per_s=rates["aborts"], compressions_per_s=rates["compressions"]))
        since = now - self.last_step if self.last_step is not None else None
        return Latency(windows=tuple(windows), stalled=has_work and now - self.last_activity > STALL_S,
                       since_last_step=since)
