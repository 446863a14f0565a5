"""EngineThread: the engine loop in a background thread, for interactive front ends.

Callers submit prompts (or chat messages) from any thread and iterate over the streamed text
of each request; the engine thread owns the EngineCore and is the only thread touching it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable

from zipage.engine.api.handles import SUBSCRIBER_QUEUE_SIZE, EngineClosed, EventQueue, RequestHandle, Subscribers
from zipage.engine.api.protocol import (Abort, Message, MessageHandler, StepOnce, Submit, TakeKept, TakeSnapshot,
                                        describe)
from zipage.engine.config import DEFAULT_MODEL, EngineConfig, SamplingParams
from zipage.engine.core.engine_core import EngineCore
from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import EngineSnapshot
from zipage.engine.kv.kept import KeptMap

SNAPSHOT_INTERVAL_S = 0.25
_LIVE: "weakref.WeakSet[EngineThread]" = weakref.WeakSet()
_exit_hook = []


def _close_at_exit(service: "EngineThread") -> None:
    if not _exit_hook:
        # threading's exit hooks run before concurrent.futures shuts its workers down (hooks run
        # newest first) and before daemon threads are frozen: the loop can still end cleanly.
        threading._register_atexit(_close_live_engines)
        _exit_hook.append(_close_live_engines)
    _LIVE.add(service)


def _close_live_engines() -> None:
    for service in list(_LIVE):
        service.close()


class EngineThread(MessageHandler):
    """`EngineThread(model, **knobs)`: a FrontDoor (protocol.py) to an engine on a background thread."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        self._subscribers = Subscribers()
        # Taken to post to the inbox and to close it: nothing can land in the inbox after the loop's
        # last drain, so no caller ever waits for a reply that will not come.
        self._inbox_lock = threading.Lock()
        self._inbox_closed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._step_requests = 0
        self._snapshot = self.engine.snapshot()
        self._snapshot_time = 0.0
        self._events_seen = 0
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="zipage-engine", daemon=True)
        self._thread.start()
        # At interpreter exit, stop the loop before the compression worker and daemon threads are
        # torn down under it (a busy engine would otherwise crash the process on its way out).
        _close_at_exit(self)

    # -- client side ---------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, *, session: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue a prompt (text, token ids, or a list of chat messages). Bad input raises ValueError here,
        in the caller's thread, and the engine keeps serving everyone else.

        `on_output`, if given, is called on the engine thread with every RequestOutput of this request
        (one per generated token, then the final one): a hook for callers that are not threads, such as
        an event loop. It must return quickly; if it raises, this request ends with finish_reason "error"
        (the others keep running)."""
        self._check_open()
        params = self.engine.check_params(params)  # static checks: safe from the caller's thread
        ids = self.check_prompt(prompt)
        return self._call(Submit(ids, params, session, on_output=on_output))

    def check_prompt(self, prompt) -> list[int]:
        """The token ids a prompt (text, ids or chat messages) would run with; ValueError if it could
        not run here (encoding, emptiness, max_model_len, pool size)."""
        return self.engine.check_prompt(self.engine.prompts.read(prompt))

    def abort(self, handle: RequestHandle | int) -> None:
        """Stop a request. Unknown or finished ids are ignored, and so is an abort once the engine is
        closed or failed: every request has ended then, and clean-up code calls this freely."""
        request_id = handle.id if isinstance(handle, RequestHandle) else int(handle)
        try:
            self._post(Abort(request_id), None)
        except EngineClosed:
            pass

    def snapshot(self, fresh: bool = False) -> EngineSnapshot:
        """The latest published snapshot; `fresh=True` waits for one taken now."""
        if fresh:
            try:
                return self._call(TakeSnapshot())
            except EngineClosed:
                pass
        return self._snapshot

    def kept(self, handle: RequestHandle | int) -> KeptMap:
        """Which token positions a running request's KV cache still holds, and why
        (docs/design-notes.md, "What a request still holds"), taken between two steps.
        UnknownRequest for a request the engine does not hold (never submitted, or finished)."""
        request_id = handle.id if isinstance(handle, RequestHandle) else int(handle)
        return self._call(TakeKept(request_id))

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> EventQueue:
        """A queue that receives every engine Event from now on (the oldest are dropped, and
        counted in its `dropped`, once `maxsize` wait unread)."""
        return self._subscribers.subscribe(maxsize)

    def unsubscribe(self, q: queue.Queue) -> None:
        self._subscribers.unsubscribe(q)

    # Teaching mode: hold the loop and advance it one step at a time.
    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._wake.set()

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs (false once closed or failed)."""
        return self._thread.is_alive()

    @property
    def can_pause(self) -> bool:
        return True  # the loop is this process's own

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def step_once(self, timeout: float = 30.0) -> EngineSnapshot:
        """While paused: run exactly one engine step and return the snapshot after it."""
        return self._call(StepOnce(), timeout)

    def close(self) -> None:
        """Abort what still runs (each handle ends with "abort"), free the pool and stop the thread."""
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._inbox_closed

    # -- the inbox: every request to the engine thread ------------------------------------
    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineClosed(f"the engine thread failed: {self.failure!r}")
        if self._inbox_closed or self._stop.is_set():
            raise EngineClosed("engine is closed")

    def _post(self, message: Message, reply: queue.Queue | None) -> None:
        with self._inbox_lock:
            self._check_open()
            self._inbox.put((message, reply))
        self._wake.set()

    def _call(self, message: Message, timeout: float | None = None):
        """Post to the engine thread and wait for its answer. A closing loop answers every message
        it still holds, so this never waits on a stopped engine."""
        reply: queue.Queue = queue.Queue()
        self._post(message, reply)
        try:
            ok, value = reply.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the engine did not answer {describe(message)!r} within {timeout} s") from None
        if not ok:
            raise value
        return value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- engine side ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self._paused.is_set() or not self.engine.has_work():
                    if self.engine.inflight is not None:  # paused: what was computed is shown
                        self._deliver(self.engine.finish_inflight())
                    self._publish(force=False)
                    self._wake.wait(timeout=SNAPSHOT_INTERVAL_S)
                    self._wake.clear()
                    continue
                self._run_step()
        except BaseException as e:  # the loop itself broke: every request ends "error" with the cause
            self.failure = e
            for handle in list(self._handles.values()):
                handle._push(RequestOutput(handle.id, handle.session, [], [], "", "", True, "error",
                                           f"engine thread failed: {e!r}"))
            raise
        finally:
            self._close_inbox()
            try:
                for request_id in list(self.engine.requests):
                    out = self.engine.abort(request_id)
                    if out is not None:
                        self._deliver([out])
                self.engine.close()
            finally:
                self._publish(force=True)

    def _close_inbox(self) -> None:
        """Refuse new messages, then answer every one still queued: submits and waits fail with the
        reason, aborts are moot (every request is about to end)."""
        with self._inbox_lock:
            self._inbox_closed = True
        reason = (EngineClosed(f"the engine thread failed: {self.failure!r}") if self.failure is not None
                  else EngineClosed("engine is closed"))
        while True:
            try:
                _, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            if reply is not None:
                reply.put((False, reason))

    def _run_step(self) -> None:
        self._deliver(self.engine.step())
        self._publish(force=False)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.handle(message, reply)
            except BaseException as e:
                # The loop is about to fail; this message has left the inbox, so _close_inbox will not
                # answer it: answer it here, or its caller would wait forever.
                if reply is not None:
                    reply.put((False, EngineClosed(f"the engine thread failed: {e!r}")))
                raise

    # The messages, on the engine thread (MessageHandler dispatches them here).
    def on_submit(self, message: Submit, reply: queue.Queue) -> None:
        seq = self.engine.enqueue(message.ids, message.params, session=message.session, stream=True)  # submit checked it
        handle = RequestHandle(seq.id, message.session, seq.num_prompt_tokens, message.on_output)
        self._handles[seq.id] = handle
        reply.put((True, handle))

    def on_abort(self, message: Abort, reply: None) -> None:
        out = self.engine.abort(message.request_id)
        if out is not None:
            self._deliver([out])

    def on_snapshot(self, message: TakeSnapshot, reply: queue.Queue) -> None:
        reply.put((True, self._publish(force=True)))

    def on_kept(self, message: TakeKept, reply: queue.Queue) -> None:
        try:
            reply.put((True, self.engine.kept(message.request_id)))
        except Exception as e:  # the caller's question failed, not the engine loop
            reply.put((False, e))

    def on_step(self, message: StepOnce, reply: queue.Queue) -> None:
        """One whole step by hand (teaching mode): its tokens are read before the reply."""
        if self.engine.has_work():
            self._deliver(self.engine.step() + self.engine.finish_inflight())
        reply.put((True, self._publish(force=True)))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.id)
            if handle is None:
                continue
            handle._push(out)
            if handle.done:
                del self._handles[out.id]
                if not out.finished:  # its own on_output hook failed: free the request (nobody reads it)
                    self.engine.abort(out.id)

    def _publish(self, force: bool) -> EngineSnapshot:
        now = time.monotonic()
        new_events, self._events_seen = self.engine.events_since(self._events_seen)
        if new_events:
            self._subscribers.publish(new_events)
        if force or now - self._snapshot_time >= SNAPSHOT_INTERVAL_S:
            self._snapshot = self.engine.snapshot()
            self._snapshot_time = now
        return self._snapshot
