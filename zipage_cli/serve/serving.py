"""What every endpoint shares while the server runs: the engine client, the metrics, the engine snapshot
kept recent, the requests open in the engine, the shutdown grace that ends them, and the lifespan that
starts and closes these with the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Callable

from zipage.engine.events import EngineSnapshot
from zipage.cli.serve.engine_client import EngineClient
from zipage.cli.serve.guards import ServeLimits
from zipage.cli.serve.metrics import ServerMetrics

SNAPSHOT_REFRESH_S = 1.0  # how often the server asks for a snapshot, so that /metrics and /health never wait for one


class SnapshotKeeper:
    """The latest engine snapshot, kept recent by asking the engine every SNAPSHOT_REFRESH_S and whenever
    the server's last open request ends: /metrics and /health read it and never wait on an engine that
    may be stuck."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.kept: EngineSnapshot = engine.process.first_snapshot
        self.wanted = asyncio.Event()

    @property
    def latest(self) -> EngineSnapshot:
        """The newest of those asked for and those the engine sent on its own (with a request's end)."""
        sent = self.engine.last_snapshot
        return sent if sent.time > self.kept.time else self.kept

    def adopt(self, snap: EngineSnapshot) -> None:
        if snap.time >= self.kept.time:
            self.kept = snap

    def refresh_soon(self) -> None:
        self.wanted.set()

    def step_age_s(self) -> float | None:
        """Seconds since the engine last finished a step (None before its first): the snapshot's own
        count plus the time since it was taken, so it keeps growing while a stuck engine sends none."""
        since = self.latest.latency.since_last_step
        return None if since is None else since + max(0.0, time.time() - self.latest.time)

    async def run(self) -> None:
        while self.engine.alive:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wanted.wait(), SNAPSHOT_REFRESH_S)
            self.wanted.clear()
            self.adopt(await self.engine.snapshot(fresh=True))


class OpenRequests:
    """The requests this server has in the engine: the pending work /health watches, and what a
    shutdown ends."""

    def __init__(self, on_idle: Callable[[], None]):
        self.ids: set[int] = set()
        self.busy_since: float | None = None
        self.on_idle = on_idle

    def add(self, request_id: int) -> None:
        if not self.ids:
            self.busy_since = time.monotonic()
        self.ids.add(request_id)

    def remove(self, request_id: int) -> None:
        self.ids.discard(request_id)
        if not self.ids and self.busy_since is not None:
            self.busy_since = None
            self.on_idle()

    def busy_for(self) -> float | None:
        return None if self.busy_since is None else time.monotonic() - self.busy_since


class ShutdownGrace:
    """Once the server stops accepting, open requests have `grace_s` to finish; then each one left is
    aborted in the engine and ends with an error (an error event and [DONE] on a stream): closing the
    engine client fails every request it still feeds."""

    def __init__(self, engine: EngineClient, requests: OpenRequests, grace_s: float):
        self.engine, self.requests, self.grace_s = engine, requests, grace_s
        self.over = False
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        if self._timer is None and not self.over:
            self._timer = asyncio.get_running_loop().call_later(self.grace_s, self.end_open_requests)

    def end_open_requests(self) -> None:
        self.over = True
        for request_id in list(self.requests.ids):
            self.engine.abort(request_id)
        self.engine.close()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


@dataclass
class Serving:
    """What every endpoint shares."""

    engine: EngineClient
    metrics: ServerMetrics
    snapshots: SnapshotKeeper
    requests: OpenRequests
    shutdown: ShutdownGrace
    stall_s: float

    @classmethod
    def around(cls, engine: EngineClient, limits: ServeLimits) -> "Serving":
        snapshots = SnapshotKeeper(engine)
        requests = OpenRequests(on_idle=snapshots.refresh_soon)  # the idle state shows at once
        return cls(engine, ServerMetrics(), snapshots, requests,
                   ShutdownGrace(engine, requests, limits.shutdown_grace_s), limits.stall_s)

    def stalled_for(self) -> float | None:
        """Seconds the engine has had work without finishing a step, once past `stall_s`; else None."""
        busy = self.requests.busy_for()
        if busy is None:
            return None
        age = self.snapshots.step_age_s()
        stalled = busy if age is None else min(busy, age)
        return stalled if stalled > self.stall_s else None


def engine_lifespan(serving: Serving):
    """The engine's turns are read on the server's event loop: it starts with the loop and closes with it,
    and so does the task that keeps its snapshot recent."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        serving.engine.start()
        keeper = asyncio.ensure_future(serving.snapshots.run())
        try:
            yield
        finally:
            serving.shutdown.cancel()
            serving.engine.close()
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    return lifespan
