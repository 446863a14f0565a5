"""Prometheus metrics of a serving engine: gauges and counters read from the last engine snapshot the
server holds at scrape time (a scrape never waits on the engine), the engine's liveness, and the
latency histograms and request counters the server keeps as tokens stream out. docs/serving.md lists
every name and label."""

from __future__ import annotations

import bisect
import math
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
CLIENT_DISCONNECTED, SHUTDOWN = "client_disconnected", "shutdown"
ABORT_REASONS = (CLIENT_DISCONNECTED, SHUTDOWN)

# Lifetime counters of the snapshot's `totals`: name there -> (metric name, help).
TOTALS = {
    "prompt_tokens": ("zipage_prompt_tokens", "Prompt tokens admitted."),
    "generated_tokens": ("zipage_generation_tokens", "Tokens generated."),
    "prefix_hit_tokens": ("zipage_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
    "preemptions": ("zipage_preemptions", "Requests preempted for lack of KV blocks."),
    "compressions": ("zipage_compressions", "KV compressions completed."),
    "pool_compressions": ("zipage_pool_compressions",
                          "KV compressions run because the pool was short (elastic budgets), of all compressions."),
}


class SnapshotCollector(Collector):
    """Engine state as of the snapshot the current scrape was given. Once the engine is gone, only its
    liveness (0) and its lifetime counters are exported: gauges of a dead engine would pass for live."""

    def __init__(self):
        self.snapshot: EngineSnapshot | None = None
        self.alive = True
        self.step_age_s: float | None = None

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        yield _gauge("zipage_engine_alive", "1 while the engine process runs and answers, else 0.", int(self.alive))
        for key, (name, text) in TOTALS.items():
            yield CounterMetricFamily(name, text, value=snap.totals.get(key, 0))
        if self.alive:
            yield from self.live_state(snap)

    def live_state(self, snap: EngineSnapshot):
        if self.step_age_s is not None:
            yield _gauge("zipage_engine_last_step_age_seconds", "Seconds since the engine last finished a step.",
                         self.step_age_s)
        yield _gauge("zipage_requests_running", "Requests in the running batch.", snap.running)
        yield _gauge("zipage_requests_waiting", "Requests waiting for admission.", snap.waiting)
        pool = snap.pool
        yield _gauge("zipage_kv_blocks_total", "KV blocks in the pool.", pool.total)
        yield _gauge("zipage_kv_blocks_used", "KV blocks held by requests.", pool.used)
        yield _gauge("zipage_kv_blocks_cached", "Free KV blocks that still hold a reusable prefix.", pool.cached)
        yield _gauge("zipage_kv_cache_usage_ratio", "Share of KV blocks held by requests (0-1).",
                     pool.used / pool.total if pool.total else 0.0)
        yield _gauge("zipage_query_slots_used", "Query slots held (requests that can be scored).",
                     pool.query_slots_used)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


class SharedValueHistogram(Collector):
    """A histogram that takes n equal observations at the cost of one (the tokens of one output share
    its gap). Observed and collected on one thread."""

    def __init__(self, name: str, text: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.text = name, text
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self):
        cumulative, total = [], 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            cumulative.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(self.name, self.text, buckets=cumulative, sum_value=self.sum)


class ServerMetrics:
    """One registry per server, so several apps in one process never share metrics."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine_state = SnapshotCollector()
        self.registry.register(self.engine_state)
        self.ttft = Histogram("zipage_time_to_first_token_seconds", "From request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = SharedValueHistogram("zipage_inter_token_latency_seconds",
                                        "Time between two tokens of one request.", ITL_BUCKETS, self.registry)
        self.e2e = Histogram("zipage_e2e_request_latency_seconds", "From request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("zipage_requests", "Requests ended, by finish reason.", ["finish_reason"],
                                registry=self.registry)
        self.aborted = Counter("zipage_requests_aborted", "Requests stopped before their end, by reason.",
                               ["reason"], registry=self.registry)
        self.errors = Counter("zipage_errors", "Requests answered with an error or ended by one, by reason.",
                              ["reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # present from the start, so that rates of them exist before the first
            self.finished.labels(reason)
        for reason in ABORT_REASONS:
            self.aborted.labels(reason)

    def render(self, snapshot: EngineSnapshot, alive: bool = True, step_age_s: float | None = None) -> bytes:
        """The text exposition format, engine gauges taken from `snapshot` (render runs on one thread)."""
        state = self.engine_state
        state.snapshot, state.alive, state.step_age_s = snapshot, alive, step_age_s
        return generate_latest(self.registry)

    def count_client_gone(self) -> None:
        """A request stopped because its client left: its last output never reaches a reader."""
        self.aborted.labels(CLIENT_DISCONNECTED).inc()
        self.finished.labels("abort").inc()

    def count_dropped(self) -> None:
        """A request stopped because another prompt of its call failed: a call ends as a whole."""
        self.finished.labels("abort").inc()

    def count_shutdown_end(self) -> None:
        """A request the shutdown ended (its output, finished with an error, is counted as it streams)."""
        self.aborted.labels(SHUTDOWN).inc()

    def count_error(self, reason: str) -> None:
        self.errors.labels(reason).inc()


class LatencyTracker:
    """Feeds one request's outputs to the histograms, timed as the server streams them: the tokens of
    one output share the gap since the output before (those that came with the first, none)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = self.last = time.monotonic()
        self.tokens = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        new = out.num_output_tokens - self.tokens
        if new > 0:
            if self.tokens == 0:
                self.metrics.ttft.observe(now - self.arrival)
                if new > 1:
                    self.metrics.itl.observe(0.0, new - 1)
            else:
                self.metrics.itl.observe((now - self.last) / new, new)
            self.tokens, self.last = out.num_output_tokens, now
        if out.finished:
            self.metrics.finished.labels(out.finish_reason or "unknown").inc()
            if self.tokens:
                self.metrics.e2e.observe(now - self.arrival)
