"""What a streaming front door hands its callers: a `RequestHandle` per request (iterate it for the
text as it streams, or wait for its result), and an `EventQueue` per observer, fed by `Subscribers`.
Shared by EngineThread, the server's EngineClient and the console's RemoteEngine."""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable

from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import Event

SUBSCRIBER_QUEUE_SIZE = 10_000  # events an unread subscriber queue holds before dropping the oldest
_END = object()


class RequestHandle:
    """A submitted request. Iterating yields text deltas until the request ends."""

    def __init__(self, request_id: int, session: str | None, prompt_tokens: int,
                 on_output: Callable[[RequestOutput], None] | None = None):
        self.id = request_id
        self.session = session
        self.prompt_tokens = prompt_tokens
        self._deltas: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self.output: RequestOutput | None = None
        self._on_output = on_output

    def __iter__(self):
        while True:
            item = self._deltas.get()
            if item is _END:
                self._deltas.put(_END)  # a second iteration (or another reader) ends at once too
                return
            yield item

    def _push(self, out: RequestOutput) -> None:
        if self._done.is_set():
            return  # the first end is the one reported (an error is never overwritten by an abort)
        if self._on_output is not None:
            out = self._call_hook(out)
        if out.delta:
            self._deltas.put(out.delta)
        if out.finished:
            self.output = out
            self._deltas.put(_END)
            self._done.set()

    def _call_hook(self, out: RequestOutput) -> RequestOutput:
        """Run the caller's on_output hook. If it raises, this request ends with the error (the engine
        thread frees it, see EngineThread._deliver) and the hook is not called again: one caller's
        broken hook must not stop the engine for everyone."""
        try:
            self._on_output(out)
            return out
        except Exception as e:
            self._on_output = None
            return dataclasses.replace(out, finished=True, finish_reason="error",
                                       error=f"on_output hook raised {e!r}")

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to end and return its final output."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        return self.output  # type: ignore[return-value]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output else None


class EventQueue(queue.Queue):
    """A subscriber's queue of events. Bounded: when nobody reads it, the oldest events are dropped
    and counted in `dropped`, so an idle subscriber never grows memory without end."""

    def __init__(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE):
        super().__init__(maxsize)
        self.dropped = 0

    def offer(self, event: Event) -> None:
        while True:
            try:
                self.put_nowait(event)
                return
            except queue.Full:
                try:
                    self.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass


class Subscribers:
    """The event queues of every observer, fed from one thread and read from others."""

    def __init__(self):
        self._queues: list[EventQueue] = []
        self._lock = threading.Lock()

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> EventQueue:
        q = EventQueue(maxsize)
        with self._lock:
            self._queues.append(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            if q in self._queues:
                self._queues.remove(q)

    def publish(self, events: list[Event]) -> None:
        with self._lock:
            for q in self._queues:
                for event in events:
                    q.offer(event)


class EngineClosed(RuntimeError):
    """The engine no longer takes requests: it was closed, or its thread failed (see the message)."""
