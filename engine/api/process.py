"""The engine in a process of its own, for servers.

A child process runs EngineCore's loop; the parent keeps the tokenizer. The parent turns prompts
into token ids and streamed token ids back into text, so the child spends its time stepping the
engine and never competes with the parent's work (HTTP, JSON) for one interpreter lock.

They talk over two pipes. The parent sends the front-door messages (protocol.py) over a
multiprocessing connection: Submit (prompt ids, SamplingParams, session and a key), Abort,
TakeSnapshot (answered after the next step, under its key), TakeKept (taken before the next step,
answered under its key) and Close (abort everything and exit). The child answers, in frames the
parent reads without blocking (frames.py), with at most one `Turn` per loop turn (one engine step):
what became of the submits it took, the new token ids of every running request (with their
logprobs, and a prompt's once, where asked), the requests that ended, the engine's new events and
the snapshots and kept maps asked for. The child detokenizes only requests with stop strings (the
engine must match them); for the others it submits with `stream=False`, reads their new ids off the
engine's sequences, and leaves the text to the parent (request_stream.py).
"""

from __future__ import annotations

import fcntl
import multiprocessing
import select
import signal
import threading
import traceback
import weakref
from dataclasses import dataclass, field

from zipage.engine.config import EngineConfig
from zipage.engine.core.engine_core import EngineCore
from zipage.engine.core.outputs import PromptTooLong, RequestOutput, UnknownRequest
from zipage.engine.events import EngineSnapshot, Event
from zipage.engine.api.frames import FrameReader, write_frame
from zipage.engine.api.protocol import Abort, Close, Message, MessageHandler, Submit, TakeKept, TakeSnapshot
from zipage.engine.kv.kept import KeptMap
from zipage.engine.loading.loader import resolve_model
from zipage.engine.loading.prompts import PromptReader

STOP_TIMEOUT_S = 30.0  # how long a closing child may take to free the pool before it is killed
PIPE_BYTES = 1 << 20  # room for many turns, so a parent busy for a moment never holds the engine up


class EngineGone(RuntimeError):
    """The engine process no longer answers: it was closed, failed or was killed (see the message)."""


@dataclass
class Turn:
    """Everything one loop turn of the child has to tell the parent."""

    accepted: list[tuple[int, int, int]] = field(default_factory=list)  # (key, request id, prompt tokens)
    refused: list[tuple[int, ValueError]] = field(default_factory=list)  # (key, why); PromptTooLong stays one
    # (request id, new output ids, text delta): the delta is None when the parent detokenizes
    tokens: list[tuple[int, list[int], str | None]] = field(default_factory=list)
    # Where asked, beside those ids: (request id, their TokenLogprobs, the prompt's with the first ids else None)
    logprobs: list[tuple[int, list, list | None]] = field(default_factory=list)
    ended: list[RequestOutput] = field(default_factory=list)  # final outputs, every output id in them
    events: list[Event] = field(default_factory=list)
    snapshot: tuple[list[int], EngineSnapshot] | None = None  # (keys that asked, the snapshot)
    # (key, the map asked for, or why there is none: UnknownRequest, or a RuntimeError that says why)
    kept: list[tuple[int, KeptMap | Exception]] = field(default_factory=list)
    failure: str | None = None  # the loop broke: the child exits after this turn

    def __bool__(self) -> bool:
        return bool(self.accepted or self.refused or self.tokens or self.logprobs or self.ended or self.events
                    or self.snapshot or self.kept or self.failure)


# -- the child ------------------------------------------------------------------------------------
def run_engine_process(inbox, outbox, config: EngineConfig) -> None:
    """The child's entry point: build the engine, say ready (or why not), then serve the parent.
    `inbox` is the connection the parent sends on; turns go out as frames on `outbox`'s pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: the parent decides
    out = outbox.fileno()
    try:
        engine = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        if not isinstance(e, ValueError):  # a bad knob or model is said in one line; anything else in full
            traceback.print_exc()
        write_frame(out, ("failed", ValueError(str(e)) if isinstance(e, ValueError)
                          else EngineGone(f"the engine failed to start: {type(e).__name__}: {e}")))
        return
    try:
        write_frame(out, ("ready", {"max_model_len": engine.max_model_len, "snapshot": engine.snapshot()}))
        EngineLoop(inbox, out, engine).run()
    finally:
        engine.close()


class EngineLoop(MessageHandler):
    """The child's side: EngineCore stepped between the parent's messages."""

    def __init__(self, inbox, out: int, engine: EngineCore):
        self.inbox, self.out, self.engine = inbox, out, engine
        self.live: dict[int, list] = {}  # request id -> [Sequence, tokens already sent (prompt included)]
        self.events_seen = engine.event_count
        self.snapshot_keys: list[int] = []
        self.closing = False

    def run(self) -> None:
        try:
            while not self.closing:
                turn = Turn()
                self.receive(turn, wait=not self.engine.has_work())
                if self.engine.has_work() and not self.closing:
                    self.step(turn)
                self.finish_turn(turn)
        except BaseException as e:  # noqa: BLE001 - the parent ends every request with the cause
            try:
                write_frame(self.out, Turn(failure=f"{type(e).__name__}: {e}"))
            except OSError:
                pass
            raise

    def receive(self, turn: Turn, wait: bool) -> None:
        """Handle every waiting message; with `wait`, sleep until one comes (an idle engine)."""
        try:
            if not self.inbox.poll(None if wait else 0):
                return
            while True:
                self.handle(self.inbox.recv(), turn)  # the turn collects the answers
                if self.closing or not self.inbox.poll(0):
                    return
        except (EOFError, OSError):  # the parent is gone: nobody is left to serve
            self.closing = True

    # The messages (MessageHandler dispatches them here); each answer goes in this turn.
    def on_submit(self, message: Submit, turn: Turn) -> None:
        try:
            seq = self.engine.add_request(message.ids, message.params, session=message.session, stream=False)
        except ValueError as e:  # rebuilt from its message: any subclass's own arguments may not pickle
            turn.refused.append((message.key, (PromptTooLong if isinstance(e, PromptTooLong) else ValueError)(str(e))))
            return
        self.live[seq.id] = [seq, seq.num_prompt_tokens]
        turn.accepted.append((message.key, seq.id, seq.num_prompt_tokens))

    def on_abort(self, message: Abort, turn: Turn) -> None:
        out = self.engine.abort(message.request_id)
        if out is not None:
            self.live.pop(out.id, None)
            turn.ended.append(out)

    def on_snapshot(self, message: TakeSnapshot, turn: Turn) -> None:
        self.snapshot_keys.append(message.key)

    def on_kept(self, message: TakeKept, turn: Turn) -> None:
        try:
            turn.kept.append((message.key, self.engine.kept(message.request_id)))
        except UnknownRequest as e:
            turn.kept.append((message.key, e))
        except Exception as e:  # noqa: BLE001 - the question failed, not the loop; rebuilt so that it pickles
            turn.kept.append((message.key, RuntimeError(f"{type(e).__name__}: {e}")))

    def on_close(self, message: Close, turn: Turn) -> None:
        self.closing = True

    def step(self, turn: Turn) -> None:
        deltas = {}
        for out in self.engine.step():
            if out.finished:
                self.live.pop(out.id, None)
                turn.ended.append(out)
            else:  # only requests the engine detokenizes (stop strings) report unfinished outputs
                deltas[out.id] = out.delta
        for request_id, entry in self.live.items():
            seq, sent = entry
            n = len(seq.token_ids)
            if n > sent:
                turn.tokens.append((request_id, seq.token_ids[sent:n], deltas.get(request_id)))
                if seq.logprobs is not None or seq.prompt_logprobs is not None:
                    turn.logprobs.append(_new_logprobs(request_id, seq, sent, n))
                entry[1] = n

    def finish_turn(self, turn: Turn) -> None:
        turn.events, self.events_seen = self.engine.events_since(self.events_seen)
        # A snapshot also goes with the turn that ends the last request: whoever reads the parent's
        # latest snapshot after an answer ends sees the engine idle, with that request counted.
        if self.snapshot_keys or (turn.ended and not self.engine.has_work()):
            turn.snapshot = (self.snapshot_keys, self.engine.snapshot())
            self.snapshot_keys = []
        if turn and not self.closing:
            try:
                write_frame(self.out, turn)
            except BrokenPipeError:  # the parent is gone
                self.closing = True


def _new_logprobs(request_id: int, seq, sent: int, n: int) -> tuple[int, list, list | None]:
    """The logprobs of tokens sent .. n - 1, and the prompt's with a request's first tokens."""
    prompt = seq.num_prompt_tokens
    new = seq.logprobs[sent - prompt:n - prompt] if seq.logprobs is not None else []
    return request_id, new, seq.prompt_logprobs if sent == prompt else None


# -- the parent -----------------------------------------------------------------------------------
class EngineProcess:
    """The parent's handle on the engine child: start it (blocking until the model is loaded), send
    it messages, read its turns, stop it. One reader at a time; sending is thread-safe."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.source = resolve_model(config.model)  # config and tokenizer only; the child loads the weights
        self.tokenizer = self.source.tokenizer
        self.prompts = PromptReader(self.source)  # prompts are read here, where the tokenizer is
        context = multiprocessing.get_context("spawn")  # the parent must never touch CUDA before a fork
        child_inbox, self.outbox = context.Pipe(duplex=False)
        self.inbox, child_outbox = context.Pipe(duplex=False)
        _grow_pipe(self.inbox.fileno())
        self.process = context.Process(target=run_engine_process, args=(child_inbox, child_outbox, config),
                                       name="zipage-engine")
        self._send_lock = threading.Lock()
        self.exit_reason: str | None = None  # set once the child is gone
        self.process.start()
        # The child's ends live in the child alone, so its death reads as end-of-file here.
        child_inbox.close()
        child_outbox.close()
        self.reader = FrameReader(self.inbox.fileno())
        # At interpreter exit a child still running is stopped, whatever the caller forgot.
        self._finalizer = weakref.finalize(self, _stop_child, self.process, self.outbox, self.inbox, 5.0)
        try:
            ready = self._wait_ready()
        except BaseException:
            self.close(timeout=5.0)
            raise
        self.max_model_len: int = ready["max_model_len"]
        self.first_snapshot: EngineSnapshot = ready["snapshot"]

    def _wait_ready(self) -> dict:
        while True:
            select.select([self.reader.fd], [], [])  # Ctrl+C interrupts the wait
            messages = self.reader.read()
            if messages:
                kind, payload = messages[0]
                if kind == "failed":
                    raise payload
                return payload
            if self.reader.eof:
                self.process.join(5.0)
                raise EngineGone(f"the engine process exited while loading (exit code {self.process.exitcode})")

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.exit_reason is None and self.process.is_alive()

    def fileno(self) -> int:
        """What to watch for turns (readable: call `receive`)."""
        return self.reader.fd

    def send(self, message: Message) -> None:
        """EngineGone when the child can no longer be reached."""
        if self.exit_reason is not None:
            raise EngineGone(self.exit_reason)
        try:
            with self._send_lock:
                self.outbox.send(message)
        except (OSError, ValueError) as e:  # a broken pipe, or the connection closed here
            raise EngineGone(f"the engine process cannot be reached: {e}") from None

    def receive(self) -> list[Turn]:
        """Every whole turn that has arrived (none if none); never blocks. Once the child is gone,
        `exit_reason` says so, after the turns it sent before going."""
        if self.exit_reason is not None:
            return []
        turns = self.reader.read()
        for turn in turns:
            if turn.failure is not None:
                self.exit_reason = f"the engine process failed: {turn.failure}"
        if self.reader.eof and self.exit_reason is None:
            self.process.join(1.0)
            self.exit_reason = f"the engine process exited (exit code {self.process.exitcode})"
        return turns

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to abort everything and exit; kill it if it does not within `timeout`. Idempotent."""
        if self.exit_reason is None:
            self.exit_reason = "the engine was closed"
        self._finalizer.detach()
        _stop_child(self.process, self.outbox, self.inbox, timeout)


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or above the system's limit: the default size still works
        pass


def _stop_child(process, outbox, inbox, timeout: float) -> None:
    if process.is_alive():
        try:
            outbox.send(Close())
        except (OSError, ValueError):
            pass
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
    outbox.close()
    inbox.close()
