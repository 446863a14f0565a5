"""The server's side of the engine process (engine/api/process.py), on its asyncio event loop.

The loop reads the child's turns itself, with a reader on the pipe: one callback per engine step
hands every request its new token ids, with no thread or lock in between. A request's reader takes
what has gathered when it is ready for more, as one output: text is detokenized then, once for all
the ids it finds, so a reader that lags sends fewer, larger chunks and catches up. Several prompts
of one API call are submitted together, one engine request each, and read as one stream
(`SubmittedTogether`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from zipage.engine.config import SamplingParams
from zipage.engine.core.outputs import PromptTooLong, RequestOutput
from zipage.engine.events import EngineSnapshot
from zipage.engine.kv.kept import KeptMap
from zipage.engine.api.process import EngineGone, EngineProcess, Turn
from zipage.engine.api.protocol import Abort, Submit, TakeKept, TakeSnapshot
from zipage.engine.api.request_stream import RequestStream
from zipage.engine.api.handles import SUBSCRIBER_QUEUE_SIZE, EventQueue, Subscribers

SNAPSHOT_MAX_AGE_S = 0.25  # a snapshot younger than this is served again rather than asked for


class Feed:
    """One request's outputs on the event loop: its stream, and the event set when something arrives,
    which the requests submitted together share, so that one reader waits on all of them."""

    def __init__(self, stream: RequestStream, arrived: asyncio.Event):
        self.stream = stream
        self.arrived = arrived

    async def next(self) -> RequestOutput:
        """Everything new since the last call, as one output (finished: the last one)."""
        while True:
            out = self.stream.take()
            if out is not None:
                return out
            self.arrived.clear()
            await self.arrived.wait()


@dataclass
class Submitted:
    """A request the engine took: its id there, its prompt's length, and its outputs."""

    id: int
    prompt_tokens: int
    feed: Feed
    prompt_ids: list[int] = field(default_factory=list)  # what a stream that echoes the prompt shows


@dataclass
class SubmittedTogether:
    """Requests submitted in one call, one per prompt in prompt order, read as one stream."""

    requests: list[Submitted]
    arrived: asyncio.Event  # the event all their feeds set

    async def next(self) -> list[tuple[int, RequestOutput]]:
        """(index, output) of every request with something new since the last call (at least one); each
        output holds everything of its request since its last one. Call it while one is unfinished."""
        while True:
            news = [(index, out) for index, request in enumerate(self.requests)
                    if (out := request.feed.stream.take()) is not None]
            if news:
                return news
            self.arrived.clear()
            await self.arrived.wait()


class EngineClient:
    """An AsyncFrontDoor (engine/api/protocol.py) to an EngineProcess, on one event loop.
    `start()` and `close()` run on that loop (the server's startup and shutdown)."""

    def __init__(self, process: EngineProcess):
        self.process = process
        self.config = process.config
        self.max_model_len = process.max_model_len
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keys = itertools.count()
        self._submits: dict[int, tuple[asyncio.Future, SamplingParams, str | None, asyncio.Event]] = {}
        self._feeds: dict[int, Feed] = {}
        self._snapshot_waiters: dict[int, asyncio.Future] = {}
        self._kept_waiters: dict[int, asyncio.Future] = {}
        self._snapshot = process.first_snapshot
        self._snapshot_time = 0.0
        self._subscribers = Subscribers()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.process.alive:
            self._fail(self.process.exit_reason or "the engine process is not running")
            return
        self._loop.add_reader(self.process.fileno(), self._on_readable)

    def close(self) -> None:
        """Stop reading; requests still open end with an error (the process is closed by its owner)."""
        self._fail("the server is shutting down")

    @property
    def alive(self) -> bool:
        return self.failure is None and self.process.alive

    # -- requests ------------------------------------------------------------------------------
    async def submit(self, prompt, params: SamplingParams, session: str | None = None) -> Submitted:
        """Tokenize here, then hand the request to the engine. ValueError for a prompt or request the
        engine refuses (the message says why), EngineGone when there is no engine to take it."""
        return (await self.submit_all([prompt], params, session)).requests[0]

    async def submit_all(self, prompts: list, params: SamplingParams, session: str | None = None
                         ) -> SubmittedTogether:
        """Each prompt as an engine request of its own, sent together so that the engine batches them.
        Every prompt is read and checked before any is sent; if the engine refuses one, those it took
        are aborted. A ValueError names the prompt's index when there are several; EngineGone when
        there is no engine to take them."""
        self._check_alive()
        all_ids = await asyncio.to_thread(self._read_all, prompts, params)  # long texts must not stall the loop
        self._check_alive()
        arrived = asyncio.Event()
        waiting = []
        try:
            for ids in all_ids:
                waiting.append(self._send(ids, params, session, arrived))
        except EngineGone:
            for accepted in waiting:  # one the engine takes all the same is aborted (_apply)
                accepted.cancel()
            raise
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        refused = [(index, why) for index, why in enumerate(answers) if isinstance(why, BaseException)]
        if refused:
            for answer in answers:
                if isinstance(answer, Submitted):
                    self.abort(answer.id)
            index, why = refused[0]
            raise _labelled(why, index, len(prompts)) if isinstance(why, ValueError) else why
        for answer, ids in zip(answers, all_ids):
            answer.prompt_ids = ids
        return SubmittedTogether(answers, arrived)

    def _read_all(self, prompts: list, params: SamplingParams) -> list[list[int]]:
        """Every prompt's ids, each checked to fit the context with its answer."""
        all_ids = []
        for index, prompt in enumerate(prompts):
            try:
                ids = self.read_prompt(prompt)
                self.check_room(len(ids), params)
            except ValueError as e:
                raise _labelled(e, index, len(prompts)) from None
            all_ids.append(ids)
        return all_ids

    def _send(self, ids: list[int], params: SamplingParams, session: str | None,
              arrived: asyncio.Event) -> asyncio.Future:
        """Hand one request to the engine: a future of its Submitted, or of why the engine refused it."""
        key = next(self._keys)
        accepted = self._loop.create_future()
        self._submits[key] = (accepted, params, session, arrived)
        try:
            self.process.send(Submit(ids, params, session, key=key))
        except EngineGone:
            del self._submits[key]
            raise
        return accepted

    def read_prompt(self, prompt) -> list[int]:
        """The prompt's token ids (text, ids, chat messages or a Chat); PromptTooLong, before any
        tokenizing, for one that cannot fit max_model_len whatever the tokenizer makes of it."""
        if isinstance(prompt, (list, tuple)) and len(prompt) > self.max_model_len and not isinstance(prompt[0], dict):
            raise PromptTooLong(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}")
        reader = self.process.prompts
        text = reader.render(prompt)
        # Refused only when even the longest tokens could not hold it (PromptReader.max_chars_per_token):
        # a 50 MB text is refused at once rather than tokenized for a minute.
        if isinstance(text, str) and len(text) > self.max_model_len * reader.max_chars_per_token:
            raise PromptTooLong(f"prompt has {len(text)} characters, more than max_model_len={self.max_model_len} "
                                "tokens can hold")
        return reader.encode(text)

    def check_room(self, prompt_tokens: int, params: SamplingParams) -> None:
        """PromptTooLong unless the prompt and its answer fit max_model_len. A max_tokens of max_model_len
        or more can never fit with a prompt: it asks for an answer as long as the context leaves room for
        (what a request without max_tokens gets), and only the prompt must fit then."""
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise PromptTooLong(f"prompt has {prompt_tokens} tokens; max_model_len is {limit} "
                                "(the prompt must leave room for at least one generated token)")
        if params.max_tokens < limit and prompt_tokens + params.max_tokens > limit:
            raise PromptTooLong(f"prompt has {prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
                                f"{prompt_tokens + params.max_tokens} in all, past max_model_len={limit} (ask for "
                                f"at most {limit - prompt_tokens} tokens, or leave max_tokens out)")

    def abort(self, request_id: int) -> None:
        """Stop a request and free its blocks; a no-op once it ended."""
        if request_id in self._feeds and self.failure is None:
            try:
                self.process.send(Abort(request_id))
            except EngineGone:
                pass

    async def snapshot(self, fresh: bool = False) -> EngineSnapshot:
        """A snapshot taken now (`fresh`), else one at most SNAPSHOT_MAX_AGE_S old; the last one
        known once the engine is gone."""
        if self.failure is not None or (not fresh and time.monotonic() - self._snapshot_time < SNAPSHOT_MAX_AGE_S):
            return self._snapshot
        key = next(self._keys)
        waiter = self._loop.create_future()
        self._snapshot_waiters[key] = waiter
        try:
            self.process.send(TakeSnapshot(key))
        except EngineGone:
            del self._snapshot_waiters[key]
            return self._snapshot
        return await waiter

    async def kept(self, request_id: int) -> KeptMap:
        """Which positions a running request's KV cache still holds, and why, taken between two engine
        steps. UnknownRequest for a request the engine does not hold; EngineGone without an engine."""
        self._check_alive()
        key = next(self._keys)
        waiter = self._loop.create_future()
        self._kept_waiters[key] = waiter
        try:
            self.process.send(TakeKept(request_id, key))
        except EngineGone:
            del self._kept_waiters[key]
            raise
        return await waiter

    @property
    def last_snapshot(self) -> EngineSnapshot:
        """The newest snapshot the engine has sent, without asking for one."""
        return self._snapshot

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> EventQueue:
        """A queue of every engine Event from now on (the oldest dropped once `maxsize` wait unread)."""
        return self._subscribers.subscribe(maxsize)

    def unsubscribe(self, q: EventQueue) -> None:
        self._subscribers.unsubscribe(q)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineGone(self.failure)

    # -- the child's turns -----------------------------------------------------------------------
    def _on_readable(self) -> None:
        for turn in self.process.receive():
            self._apply(turn)
        if self.process.exit_reason is not None:
            self._fail(self.process.exit_reason)

    def _apply(self, turn: Turn) -> None:
        feeds = self._feeds
        for key, request_id, prompt_tokens in turn.accepted:
            accepted, params, session, arrived = self._submits.pop(key)
            feed = feeds[request_id] = Feed(RequestStream(request_id, session, self.process.tokenizer, params),
                                            arrived)
            if accepted.cancelled():  # its caller left while the engine took it
                self.abort(request_id)
            else:  # it may end before its caller runs again: the feed goes along
                accepted.set_result(Submitted(request_id, prompt_tokens, feed))
        for key, why in turn.refused:
            accepted = self._submits.pop(key)[0]
            if not accepted.cancelled():
                accepted.set_exception(why)
        for request_id, ids, delta in turn.tokens:
            feed = feeds.get(request_id)
            if feed is not None:
                feed.stream.add(ids, delta)
                feed.arrived.set()
        for request_id, new, prompt in turn.logprobs:
            feed = feeds.get(request_id)
            if feed is not None:
                feed.stream.add_logprobs(new, prompt)
        for out in turn.ended:
            feed = feeds.pop(out.id, None)
            if feed is not None:
                feed.stream.end(out)
                feed.arrived.set()
        if turn.events:
            self._subscribers.publish(turn.events)
        if turn.snapshot is not None:
            keys, self._snapshot = turn.snapshot
            self._snapshot_time = time.monotonic()
            for key in keys:
                waiter = self._snapshot_waiters.pop(key, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(self._snapshot)
        for key, answer in turn.kept:
            waiter = self._kept_waiters.pop(key, None)
            if waiter is not None and not waiter.done():
                if isinstance(answer, Exception):
                    waiter.set_exception(answer)
                else:
                    waiter.set_result(answer)

    def _fail(self, reason: str) -> None:
        """The engine is gone: every request ends with an error, every waiter is answered."""
        if self.failure is not None:
            return
        self.failure = reason
        if self._loop is not None:
            try:
                self._loop.remove_reader(self.process.fileno())
            except (OSError, ValueError):  # the connection is already closed
                pass
        for feed in self._feeds.values():
            feed.stream.fail(reason)
            feed.arrived.set()
        self._feeds.clear()
        for accepted, *_ in self._submits.values():
            if not accepted.done():
                accepted.set_exception(EngineGone(reason))
        self._submits.clear()
        for waiter in self._snapshot_waiters.values():
            if not waiter.done():
                waiter.set_result(self._snapshot)
        self._snapshot_waiters.clear()
        for waiter in self._kept_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineGone(reason))
        self._kept_waiters.clear()


def _labelled(e: ValueError, index: int, count: int) -> ValueError:
    """Why the prompt at `index` was refused, saying which one when there are several (of the same
    type, so that a PromptTooLong stays one)."""
    if count == 1:
        return e
    return (PromptTooLong if isinstance(e, PromptTooLong) else ValueError)(f"prompt[{index}]: {e}")
