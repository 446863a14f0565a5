"""Immutable views of the engine for observers (UIs, benchmarks, logs): snapshots and events.

Observers never touch the scheduler or block manager; they read these frozen records.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Mapping

EVENT_KINDS = ("admitted", "prefilled", "compressed", "preempted", "finished", "aborted", "error")  # EVENT_TYPES' keys

# Block roles as drawn by the console.
ROLE_SHARED = "shared"  # a prefix block other requests reference too (never written)
ROLE_PRIVATE = "private"  # an ordinary block of this request
ROLE_REUSED = "reused"  # a prompt block served by the prefix cache at admission (held by no one else now)
ROLE_TARGET = "target"  # a block holding kept tokens after compression
ROLE_DECODE = "decode"  # the fresh block a compressed request decodes into


@dataclass(frozen=True)
class Event:
    """Something that happened to one request. Each kind is a subclass with typed fields: observers
    match on the class (or read `kind`), never on dictionary keys."""

    request: int | None
    time: float
    kind: ClassVar[str] = "event"

    @property
    def details(self) -> dict[str, Any]:
        """The kind's own fields (all but request and time), for logs and the wire format."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("request", "time")}


@dataclass(frozen=True, kw_only=True)
class Admitted(Event):
    kind: ClassVar[str] = "admitted"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    blocks: int


@dataclass(frozen=True, kw_only=True)
class Prefilled(Event):
    kind: ClassVar[str] = "prefilled"
    tokens: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Compressed(Event):
    kind: ClassVar[str] = "compressed"
    blocks_before: int
    blocks_after: int
    tokens_before: int  # KV entries per layer and head before, and kept after
    tokens_after: int
    evicted_per_layer: int
    prompt_kept: int = 0  # of the kept entries, how many were kept for being the prompt (which fit its share)
    recent_kept: int  # of the kept entries, how many were kept for being the newest
    times: int  # the request's compressions so far, this one included
    seconds: float
    reason: str = "budget"  # "budget": it reached its budget; "pool": the pool was short (elastic budgets)
    budget_blocks: int = 0  # the budget it was compressed to, in blocks


@dataclass(frozen=True, kw_only=True)
class Preempted(Event):
    kind: ClassVar[str] = "preempted"
    output_tokens: int


@dataclass(frozen=True, kw_only=True)
class Ended(Event):
    """A request left the engine; its subclass says how."""

    reason: str  # the request's finish reason
    output_tokens: int
    error: str | None = None  # the cause of an error, or why a request ended early on its own


class Finished(Ended):
    kind: ClassVar[str] = "finished"  # "stop" or "length" (error set when it outgrew the pool)


class Aborted(Ended):
    kind: ClassVar[str] = "aborted"


class Failed(Ended):
    kind: ClassVar[str] = "error"


EVENT_TYPES: dict[str, type[Event]] = {cls.kind: cls for cls in
                                       (Admitted, Prefilled, Compressed, Preempted, Finished, Aborted, Failed)}


@dataclass(frozen=True)
class RequestInfo:
    id: int
    session: str | None
    status: str
    prompt_tokens: int
    output_tokens: int
    kv_len: int
    block_table: tuple[int, ...]
    block_roles: tuple[str, ...]
    blocks_shared: int
    times_compressed: int
    query_slot: int | None
    tokens_per_s: float
    kv_budget: int | None = None  # its budget in blocks (the floor under elastic budgets); None: full KV
    compressed_for: str | None = None  # why its last compression ran: "budget" or "pool"


@dataclass(frozen=True)
class PoolInfo:
    total: int
    free: int
    used: int
    cached: int
    block_size: int
    query_slots_total: int
    query_slots_used: int
    cached_blocks: tuple[int, ...] = ()  # ids of the free blocks that still hold a reusable prefix


@dataclass(frozen=True)
class MemoryInfo:
    kv: int  # bytes of the KV pool
    weights: int
    device_used: int
    device_total: int
    kv_dtype: str = ""  # how K and V are stored: "fp8", "int8", "bf16", "fp16" or "fp32"


@dataclass(frozen=True)
class Throughput:
    prefill: float  # tokens/s over the recent window
    decode: float


@dataclass(frozen=True)
class Percentiles:
    """Seconds; None when the window saw no sample."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    count: int = 0


@dataclass(frozen=True)
class LatencyWindow:
    """What the last `seconds` looked like to the users of the engine."""

    seconds: float
    ttft: Percentiles = Percentiles()  # arrival to first token
    itl: Percentiles = Percentiles()  # between two tokens of one request
    queue: Percentiles = Percentiles()  # arrival to admission
    prefix_hit_rate: float | None = None  # prompt tokens served by the prefix cache / prompt tokens admitted
    preemptions_per_s: float = 0.0
    aborts_per_s: float = 0.0
    compressions_per_s: float = 0.0


@dataclass(frozen=True)
class Latency:
    windows: tuple[LatencyWindow, ...] = ()  # shortest first: 5, 15 and 60 s
    stalled: bool = False  # work is waiting but no step has finished for a while
    since_last_step: float | None = None  # seconds; None before the first step


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    step: int
    model: str
    device: str
    compression: bool
    requests: tuple[RequestInfo, ...]
    pool: PoolInfo
    memory: MemoryInfo
    throughput: Throughput
    events: tuple[Event, ...]
    waiting: int
    running: int
    totals: Mapping[str, int] = field(default_factory=dict)  # lifetime counters
    latency: Latency = Latency()


class ThroughputMeter:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(self, prefill_tokens: int, decode_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, prefill_tokens, decode_tokens))
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def rates(self, now: float | None = None) -> Throughput:
        now = time.monotonic() if now is None else now
        recent = [s for s in self.samples if now - s[0] <= self.window_s]
        if not recent:
            return Throughput(0.0, 0.0)
        span = max(now - recent[0][0], 1e-3)
        return Throughput(sum(s[1] for s in recent) / span, sum(s[2] for s in recent) / span)


# -- plain data (JSON) views, for observers in another process ----------------------------
def event_to_dict(event: Event) -> dict:
    return {"kind": event.kind, "request": event.request, "time": event.time, "details": dict(event.details)}


def event_from_dict(data: Mapping[str, Any]) -> Event:
    kind = EVENT_TYPES.get(data["kind"])
    if kind is None:
        raise ValueError(f"unknown event kind {data['kind']!r}")
    return kind(request=data.get("request"), time=data["time"], **dict(data.get("details") or {}))


def snapshot_to_dict(snapshot: EngineSnapshot) -> dict:
    """Plain lists, dicts and numbers: what `json.dumps` takes and `snapshot_from_dict` turns back."""
    data = asdict(snapshot)
    data["events"] = [event_to_dict(e) for e in snapshot.events]
    data["totals"] = dict(snapshot.totals)
    return data


def snapshot_from_dict(data: Mapping[str, Any]) -> EngineSnapshot:
    requests = tuple(RequestInfo(**{**r, "block_table": tuple(r["block_table"]),
                                    "block_roles": tuple(r["block_roles"])}) for r in data["requests"])
    pool = PoolInfo(**{**data["pool"], "cached_blocks": tuple(data["pool"].get("cached_blocks", ()))})
    return EngineSnapshot(
        time=data["time"], step=data["step"], model=data["model"], device=data["device"],
        compression=data["compression"], requests=requests, pool=pool, memory=MemoryInfo(**data["memory"]),
        throughput=Throughput(**data["throughput"]), events=tuple(event_from_dict(e) for e in data["events"]),
        waiting=data["waiting"], running=data["running"], totals=dict(data.get("totals") or {}),
        latency=_latency_from_dict(data.get("latency") or {}))


def _latency_from_dict(data: Mapping[str, Any]) -> Latency:
    windows = tuple(LatencyWindow(**{**w, **{k: Percentiles(**w[k]) for k in ("ttft", "itl", "queue")}})
                    for w in data.get("windows", ()))
    return Latency(windows=windows, stalled=data.get("stalled", False), since_last_step=data.get("since_last_step"))
