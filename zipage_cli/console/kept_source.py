"""Where the kept view's data comes from: the door's `kept` query (which positions a request's KV
still holds, engine/kv/kept.py) and the token ids of the requests this console submitted, for the text
of each position.

A door hands out text, not ids. So the prompt's ids are read here the way the engine reads them
(`check_prompt`, where the door has one), and the answer's come from the door's per-output hook
(`on_output`, an in-process engine) or, once the answer has ended, from its final output. An attached
server gives neither the prompt's ids nor a tokenizer: the view then draws positions without text.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import Compressed
from zipage.engine.kv.kept import KeptMap
from zipage.cli.console.kept_words import dropped_sentence
from zipage.cli.token_texts import token_pieces

BOOK_SIZE = 256  # requests whose ids are remembered; a long `zipage top` run submits without end


@dataclass
class Track:
    """One submitted request's ids: the prompt's (None where the door cannot say) and the answer's so far."""

    prompt: list[int] | None
    handle: object
    answer: list[int] = field(default_factory=list)
    logprobs: list | None = None  # the answer's TokenLogprobs, where the request asked for them

    def collect(self, out: RequestOutput) -> None:
        """The door's hook, on the engine's thread: quick, and never raising."""
        if out.finished and out.token_ids:
            self.answer[:] = out.token_ids
        else:
            self.answer.extend(out.new_token_ids)
        if self.logprobs is not None and out.finished and out.logprobs is not None:
            self.logprobs[:] = out.logprobs
        elif self.logprobs is not None:
            self.logprobs.extend(out.new_logprobs or [])


class TokenBook:
    """Submits for the console and remembers each request's token ids."""

    def __init__(self, door):
        self.door = door
        self.tracks: OrderedDict[int, Track] = OrderedDict()
        self.lock = threading.Lock()  # the chat submits from a worker thread per answer
        try:
            self.hooked = "on_output" in inspect.signature(door.submit).parameters
        except (TypeError, ValueError):
            self.hooked = False

    def submit(self, prompt, params=None, *, session: str | None = None):
        asked = params is not None and params.logprobs is not None
        track = Track(self._prompt_ids(prompt), None, logprobs=[] if asked else None)
        if self.hooked:
            handle = self.door.submit(prompt, params, session=session, on_output=track.collect)
        else:
            handle = self.door.submit(prompt, params, session=session)
        track.handle = handle
        with self.lock:
            self.tracks[handle.id] = track
            while len(self.tracks) > BOOK_SIZE:
                self.tracks.popitem(last=False)
        return handle

    def _prompt_ids(self, prompt) -> list[int] | None:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        check = getattr(self.door, "check_prompt", None)
        if check is None:
            return None
        try:
            return list(check(prompt))
        except ValueError:  # the submit that follows refuses it with the same message
            return None

    def ids(self, request: int) -> list[int] | None:
        """The request's ids so far (prompt, then answer), or None where its prompt's are unknown."""
        track = self.tracks.get(request)
        if track is None or track.prompt is None:
            return None
        answer = list(track.answer)
        output = getattr(track.handle, "output", None)
        if not answer and output is not None:  # a door without the hook: the ids come at the end
            answer = list(output.token_ids)
        return track.prompt + answer

    def prompt_tokens(self, request: int) -> int | None:
        track = self.tracks.get(request)
        return len(track.prompt) if track is not None and track.prompt is not None else None

    def pieces(self, request: int, count: int) -> list[str | None]:
        """The text of positions 0 .. count - 1 (None where unknown: no tokenizer here, or ids not in yet)."""
        ids = self.ids(request)
        tokenizer = getattr(self.door, "tokenizer", None)
        if ids is None or tokenizer is None:
            return [None] * count
        known = token_pieces(tokenizer, ids[:count])
        return known + [None] * (count - len(known))


@dataclass(frozen=True)
class Holding:
    """What the kept view draws: one request's map, the text of its positions, when it was taken."""

    request: int
    map: KeptMap
    pieces: list[str | None]
    prompt_tokens: int | None  # where the answer starts, if known
    taken: float  # time.time()
    note: str | None = None  # why the texts are missing, if they are


def can_ask(door) -> bool:
    """Whether the door answers the kept query."""
    return callable(getattr(door, "kept", None))


def prompt_tokens_of(door, request: int) -> int | None:
    """The request's prompt length, from the door's latest snapshot (any door has it, while it runs)."""
    return next((r.prompt_tokens for r in door.snapshot().requests if r.id == request), None)


def take(door, book: TokenBook | None, request: int, prompt_tokens: int | None = None) -> Holding | str:
    """Ask the door what `request` still holds (this waits for the engine: call it from a worker
    thread); the map with its texts, or why there is none."""
    if not can_ask(door):
        return "this engine does not answer the kept query"
    try:
        kmap = door.kept(request)
    except LookupError:
        return f"#{request} has ended: its KV was freed"
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:
        return f"no map for #{request}: {e}"
    if kmap is None:
        return f"#{request} is no longer in the engine: its KV was freed"
    pieces = book.pieces(request, kmap.num_positions) if book is not None else [None] * kmap.num_positions
    if prompt_tokens is None and book is not None:
        prompt_tokens = book.prompt_tokens(request)
    note = None
    if pieces and all(p is None for p in pieces):
        note = ("the server sends no token ids: positions are drawn as cells"
                if getattr(door, "tokenizer", None) is None else
                "another client sent this request: its token texts are not known here")
    return Holding(request, kmap, pieces, prompt_tokens, time.time(), note)


class MapMemory:
    """Teaching mode's kept maps: each request's latest one per count of compressions, taken before a
    step (the selected request) and after each compression, so that what a compression dropped can be
    named from the maps before and after it."""

    def __init__(self, door, book: TokenBook):
        self.door, self.book = door, book
        self.maps: OrderedDict[int, dict[int, KeptMap]] = OrderedDict()

    @property
    def can_ask(self) -> bool:
        return can_ask(self.door)

    def remember(self, request: int) -> KeptMap | None:
        """The request's map now (this waits for the engine), remembered; None if there is none."""
        holding = take(self.door, None, request)
        if isinstance(holding, str):
            return None
        self.maps.setdefault(request, {})[holding.map.compressions] = holding.map
        self.maps.move_to_end(request)
        while len(self.maps) > BOOK_SIZE:
            self.maps.popitem(last=False)
        return holding.map

    def dropped(self, event: Compressed) -> str | None:
        """What the compression `event` reports dropped, in words. Before a request's first compression
        it held everything; before a later one, what the latest map taken since the previous one shows
        (positions written after it are held everywhere). After a compression not seen here (no map
        since the previous one), None: nothing is named rather than something wrong."""
        before = None if event.times == 1 else self.maps.get(event.request, {}).get(event.times - 1)
        after = self.remember(event.request)
        if after is None or (before is None and event.times > 1):
            return None
        return (dropped_sentence(before, after, self.book.pieces(event.request, after.num_positions))
                or "No token left a layer: each head dropped only what another head still holds.")
