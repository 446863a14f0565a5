"""The front-door protocol: one shape for every way in to an engine (docs/design-notes.md, "Rooms").

`FrontDoor` is what a thread-based caller holds: the console, the tests and scripts. `EngineThread`
(the engine in this process) and `RemoteEngine` (a running `zipage serve`) both are one, so a console
attached to a server and a local one differ only in the object behind it. `AsyncFrontDoor` is the
same shape for an asyncio caller (the server's `EngineClient`). `LLM`, the offline door, runs whole
batches in the caller's thread; it shares the `Door` part: config, snapshot, close.

Behind a door, requests travel to the engine loop as the typed messages below; `MessageHandler`
is the one dispatch of them, and each door says what handling one means on its side (the thread
answers at once, the engine process answers in its next turn).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from zipage.engine.api.handles import SUBSCRIBER_QUEUE_SIZE, EventQueue, RequestHandle
from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import EngineSnapshot
from zipage.engine.kv.kept import KeptMap


@runtime_checkable
class Door(Protocol):
    """What every front door has: its engine's config, a snapshot of it, and a way to close it."""

    config: EngineConfig

    def snapshot(self, fresh: bool = False) -> EngineSnapshot:
        """The engine as of now (`fresh`), or as last published."""

    def close(self) -> None:
        """End every request this door still runs and release what the door holds."""


@runtime_checkable
class FrontDoor(Door, Protocol):
    """A streaming door for threads: submit, stream (iterate the handle), abort, observe, close.

    Bad input raises ValueError from `submit` (PromptTooLong for a prompt that cannot fit), in the
    caller's thread, and the engine keeps serving the others. `pause`/`resume`/`step_once` hold the
    loop for teaching; a door whose engine serves others (an attached server) raises RuntimeError."""

    tokenizer: Any  # None where the tokenizer lives on the far side (an attached server)

    def submit(self, prompt, params: SamplingParams | None = None, *, session: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue a prompt (text, token ids or chat messages); iterate the handle for its text. `on_output`
        is called with each RequestOutput of the request, on the door's own thread: it must be quick."""

    def abort(self, handle: RequestHandle | int) -> None:
        """Stop a request and free its blocks; a no-op once it ended or the door closed."""

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> EventQueue:
        """A queue of every engine Event from now on (the oldest dropped once `maxsize` wait unread)."""

    def unsubscribe(self, q: EventQueue) -> None:
        """Stop feeding a queue `subscribe` gave."""

    def kept(self, handle: RequestHandle | int) -> KeptMap:
        """Which token positions a running request's KV cache still holds, per layer and KV head, and
        why (docs/design-notes.md, "What a request still holds"). UnknownRequest (a KeyError) for a
        request the engine does not hold: never submitted there, or finished."""

    @property
    def alive(self) -> bool:
        """Whether the engine behind the door still serves."""

    @property
    def can_pause(self) -> bool:
        """Whether `pause` can hold the engine from here (False where it serves others: a server)."""

    @property
    def paused(self) -> bool:
        """Whether the loop is held for teaching."""

    def pause(self) -> None:
        """Hold the engine loop (teaching mode)."""

    def resume(self) -> None:
        """Let a held loop run again."""

    def step_once(self, timeout: float = 30.0) -> EngineSnapshot:
        """While paused: run exactly one step and return the snapshot after it."""


@runtime_checkable
class AsyncFrontDoor(Door, Protocol):
    """The streaming door for an asyncio caller: `submit` returns once the engine took the request,
    with its id and a feed of outputs (`await feed.next()` until one is finished)."""

    async def submit(self, prompt, params: SamplingParams, session: str | None = None):
        """Tokenize and hand the request over; ValueError if the engine refuses it."""

    def abort(self, request_id: int) -> None:
        """Stop a request and free its blocks; a no-op once it ended."""

    async def snapshot(self, fresh: bool = False) -> EngineSnapshot:
        """A snapshot taken now (`fresh`), else a recent one."""

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> EventQueue:
        """A queue of every engine Event from now on (the oldest dropped once `maxsize` wait unread)."""

    def unsubscribe(self, q: EventQueue) -> None:
        """Stop feeding a queue `subscribe` gave."""

    async def kept(self, request_id: int) -> KeptMap:
        """What a running request's KV cache still holds, and why; UnknownRequest if it is not live."""

    @property
    def alive(self) -> bool:
        """Whether the engine behind the door still serves."""


# -- messages to the engine loop ------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """A new request, already read into token ids and checked where the caller is."""

    ids: list[int]
    params: SamplingParams
    session: str | None = None
    key: int | None = None  # matches the engine process's answer to this message
    on_output: Callable[[RequestOutput], None] | None = None  # in-process doors only: never pickled


@dataclass(frozen=True)
class Abort:
    """Stop a request and free its blocks."""

    request_id: int


@dataclass(frozen=True)
class TakeSnapshot:
    """Take a snapshot (after the step under way, in the engine process)."""

    key: int | None = None


@dataclass(frozen=True)
class TakeKept:
    """Ask which positions a request's KV cache still holds (`EngineCore.kept`), between two steps."""

    request_id: int
    key: int | None = None  # matches the engine process's answer to this message


@dataclass(frozen=True)
class StepOnce:
    """Run one whole step of a held loop (teaching mode)."""


@dataclass(frozen=True)
class Close:
    """Abort everything and stop the loop."""


Message = Submit | Abort | TakeSnapshot | TakeKept | StepOnce | Close


def describe(message: Message) -> str:
    """A message's kind in words, for errors: "take snapshot", "step once"."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", type(message).__name__).lower()


class MessageHandler:
    """Dispatches messages to `on_<kind>` methods. A door that does not take a kind leaves its method
    out, and such a message is a ValueError that names it."""

    def handle(self, message: Message, reply=None) -> None:
        method = {Submit: "on_submit", Abort: "on_abort", TakeSnapshot: "on_snapshot", TakeKept: "on_kept",
                  StepOnce: "on_step", Close: "on_close"}.get(type(message))
        handler = getattr(self, method, None) if method else None
        if handler is None:
            raise ValueError(f"{type(self).__name__} does not take {type(message).__name__} messages")
        handler(message, reply)
