"""`zipage chat --plain`: a line-mode chat for terminals where a full-screen app is unwelcome.

Interactive terminals get prompt_toolkit (history, multi-line input with Alt+Enter); piped
standard input is read one message per line. `Conversation` (history, per-session sampling
settings, the shared slash commands) is also what the full-screen chat keeps per session.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from typing import TextIO

from zipage.engine.config import SamplingParams
from zipage.engine.core.outputs import PromptTooLong
from zipage.engine.kv.geometry import CompressionGeometry, check_request_budget
from zipage.engine.api.protocol import FrontDoor
from zipage.cli.console.saved.export import export
from zipage.cli.console.saved.saver import ChatSaver
from zipage.cli.console.saved.store import SavedSession

SETTING_COMMANDS = """\
/temp X       sampling temperature for this session (0 = greedy)
/max N        most tokens per answer
/system TEXT  system message (empty to clear)
/budget N     KV budget of this session's answers, in blocks (alone: show it;
              /budget default: back to the engine's)
/clear        forget this session's history"""

PLAIN_HELP = SETTING_COMMANDS + """
/export PATH  write this session to PATH: Markdown, or JSON for a .json file
/help         this help
/quit         leave (or Ctrl+D)
Enter sends; Alt+Enter (or Esc then Enter) starts a new line; Ctrl+C stops an answer."""


@dataclass
class Conversation:
    """One chat session: its messages and sampling settings."""

    name: str
    temperature: float = 0.7
    max_tokens: int = 512
    system: str | None = None
    history: list[dict] = field(default_factory=list)
    kv_budget: int | None = None  # blocks; None: the engine's
    saved_id: int | None = None  # its number in the saved chats, once saved

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, kv_budget=self.kv_budget)

    def messages_for(self, prompt: str) -> list[dict]:
        """The whole conversation plus the new user turn, as the chat template wants it."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": prompt}]

    def record(self, prompt: str, answer: str) -> None:
        self.history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]

    def refusal(self, e: Exception) -> str:
        """Why a message was not sent. Every message carries the whole conversation, so one that has
        outgrown the context or the KV pool says how to go on."""
        if isinstance(e, PromptTooLong) and self.history:
            return f"{e}. Each message carries the whole conversation: /clear starts it afresh"
        return str(e)

    def settings_line(self) -> str:
        system = f"system: {self.system[:24]}…" if self.system and len(self.system) > 24 else (
            f"system: {self.system}" if self.system else "no system message")
        turns = len(self.history) // 2
        budget = f" · KV budget {self.kv_budget}" if self.kv_budget is not None else ""
        return (f"temperature {self.temperature:g} · max tokens {self.max_tokens}{budget} · {system} · "
                f"{turns} turn{'s' if turns != 1 else ''}")

    def apply(self, command: str, arg: str, engine=None) -> str | None:
        """Run a settings command; returns a confirmation, None if `command` is not one,
        or raises ValueError for a bad value. `engine` (when known) checks a budget before it is kept."""
        if command in ("/temp", "/temperature"):
            value = _number(arg, float, command)
            SamplingParams(temperature=value)  # validates
            self.temperature = value
            return f"temperature {value:g}"
        if command in ("/max", "/max-tokens"):
            value = _number(arg, int, command)
            SamplingParams(max_tokens=value)
            self.max_tokens = value
            return f"max tokens {value}"
        if command == "/system":
            self.system = arg or None
            return f"system message: {arg}" if arg else "system message cleared"
        if command == "/budget":
            return self.set_budget(arg, engine)
        if command == "/clear":
            self.history.clear()
            return "history cleared"
        return None

    def set_budget(self, arg: str, engine=None) -> str:
        """`/budget N` sets this session's KV budget, `/budget default` (or off) returns to the engine's,
        `/budget` alone says which one applies."""
        if arg.lower() in ("default", "off"):
            self.kv_budget = None
        elif arg:
            value = int(arg) if arg.isdecimal() else 0
            if value < 1:
                raise ValueError(f"/budget {arg}: give a whole number of blocks >= 1, or default")
            if engine is not None:
                check_budget(engine, value)
            self.kv_budget = value
        floor = " (a floor: elastic budgets)" if _elastic(engine) else ""
        if self.kv_budget is not None:
            return f"KV budget {_blocks(self.kv_budget)}{floor}"
        if engine is None:
            return "KV budget: the engine's"
        if not engine.config.compression:
            return "KV budget: none, this engine keeps full KV (compression is off)"
        return f"KV budget: the engine's, {_blocks(engine.config.max_cache_blocks_per_seq)}{floor}"


def _blocks(n: int) -> str:
    return f"{n} block{'s' if n != 1 else ''}"


def _elastic(engine) -> bool:
    return engine is not None and engine.config.budget_policy == "elastic"


def check_budget(engine, blocks: int) -> None:
    """ValueError unless `engine` (local or attached) can run a request with this KV budget: the checks
    the engine makes when a request comes (docs/design-notes.md, "Budgets"), made when the budget is set,
    so that a bad one is refused at once rather than at the next message."""
    pool = engine.snapshot().pool
    geometry = CompressionGeometry.from_config(engine.config, pool.block_size) if engine.config.compression else None
    check_request_budget(blocks, geometry, pool.total, label=f"/budget {blocks}", noun="budget")


def _number(arg: str, kind: type, command: str):
    try:
        return kind(arg)
    except ValueError:
        raise ValueError(f"{command} needs a {'whole ' if kind is int else ''}number, got {arg!r}") from None


def split_command(line: str) -> tuple[str, str]:
    """'/temp 0.3' -> ('/temp', '0.3'); a message -> ('', message)."""
    if not line.startswith("/"):
        return "", line
    command, _, arg = line.partition(" ")
    return command.lower(), arg.strip()


class WordWrapper:
    """Streams text to a terminal `width` columns wide, breaking lines between words rather than
    inside them (a word is held back until it is complete). Words longer than a line are cut.
    Without a width (not a terminal) the text passes through unchanged."""

    def __init__(self, out: TextIO, width: int | None):
        self.out, self.width = out, None if width is None else max(8, width)
        self.column, self.word = 0, ""
        self.space = False  # a blank owed before the next word, dropped if that word wraps

    def write(self, text: str) -> None:
        if self.width is None:
            self.out.write(text)
            self.out.flush()
            return
        for char in text:
            if char == "\n":
                self._put_word()
                self._newline()
            elif char in " \t":
                self._put_word()
                self.space = self.column > 0  # no blank at the start of a line
            else:
                self.word += char
                if len(self.word) >= self.width:
                    self._put_word()
        self.out.flush()

    def finish(self) -> None:
        self._put_word()
        self.out.flush()

    def _put_word(self) -> None:
        if not self.word:
            return
        if self.column and self.column + self.space + len(self.word) > self.width:
            self._newline()
        elif self.space:
            self.out.write(" ")
            self.column += 1
        self.space = False
        self.out.write(self.word)
        self.column += len(self.word)
        self.word = ""

    def _newline(self) -> None:
        self.out.write("\n")
        self.column, self.space = 0, False


def answer(engine: FrontDoor, conv: Conversation, prompt: str, out: TextIO, saver: ChatSaver) -> None:
    """Stream one answer to `out` (word-wrapped on a terminal); Ctrl+C stops it (the partial answer
    stays in the history)."""
    handle = engine.submit(conv.messages_for(prompt), conv.params(), session=conv.name)
    saver.sent(conv, prompt, 0)
    writer = WordWrapper(out, shutil.get_terminal_size().columns if out.isatty() else None)
    try:
        for delta in handle:
            writer.write(delta)
    except KeyboardInterrupt:
        engine.abort(handle)
        writer.write(" [stopped]")
    writer.finish()
    result = handle.result()
    out.write("\n")
    out.flush()
    if result.finish_reason == "error":
        raise RuntimeError(result.error)
    conv.record(prompt, result.text)
    saver.answered(conv, result.text, None, 0)


def handle_line(engine: FrontDoor, conv: Conversation, line: str, out: TextIO, err: TextIO,
                saver: ChatSaver | None = None) -> bool:
    """Act on one input; False when the user asked to leave."""
    saver = saver or ChatSaver(None, engine.config.model)
    line = line.strip()
    if not line:
        return True
    command, arg = split_command(line)
    try:
        if command in ("/quit", "/exit"):
            return False
        if command == "/help":
            err.write(PLAIN_HELP + "\n")
        elif command == "/export":
            err.write(export(saver.for_export(conv), arg or f"{conv.name}.md") + "\n")
        elif command:
            note = conv.apply(command, arg, engine)
            err.write(f"{note}\n" if note else f"unknown command {command}; /help lists them\n")
            if note and command == "/clear":
                saver.cleared(conv)
            elif note:
                saver.settings(conv, 0)
        else:
            answer(engine, conv, line, out, saver)
    except (ValueError, RuntimeError) as e:
        err.write(f"error: {conv.refusal(e)}\n")
    return True


def typed_lines_history(saver: ChatSaver):
    """What ↑ recalls at the prompt: the lines typed in earlier plain chats, kept beside the saved chats,
    or only in memory when saving is off (--no-save keeps nothing on disk). A history file in the model
    cache folder, where it was kept before, moves along on first use."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    from zipage.engine.loading.loader import cache_dir

    if not saver.on:
        return InMemoryHistory()
    path = saver.store.path.parent / "chat_history"
    earlier = cache_dir() / "chat_history"
    if earlier.is_file() and not path.exists():
        shutil.move(earlier, path)
    return FileHistory(str(path))


def run_plain(engine: FrontDoor, conv: Conversation, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr, saver: ChatSaver | None = None, resumed: SavedSession | None = None) -> None:
    """`saver` keeps the session in the saved chats; `resumed`: a saved session to go on with."""
    saver = saver or ChatSaver(None, engine.config.model)
    saver.warn = lambda message: err.write(f"error: {message}\n")
    if resumed is not None:
        conv.name = resumed.name
        saver.resumed(conv, resumed, 0)
        turns = len(conv.history) // 2
        err.write(f"Resumed {resumed.name} (saved chat {resumed.id}): {turns} turn{'s' if turns != 1 else ''}.\n")
    if not stdin.isatty():
        for line in stdin:
            if not handle_line(engine, conv, line, out, err, saver):
                return
        return
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("enter")
    def _send(event):
        event.current_buffer.validate_and_handle()

    @keys.add("escape", "enter")  # Alt+Enter arrives as Esc, Enter
    def _newline(event):
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=typed_lines_history(saver), multiline=True,
                            key_bindings=keys,
                            prompt_continuation=lambda width, *_: "." * (width - 1) + " ")
    err.write(f"Chatting with {engine.config.model}. {conv.settings_line()}\n/help for commands, Ctrl+D to leave.\n")
    while True:
        try:
            line = session.prompt("you> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        if not handle_line(engine, conv, line, out, err, saver):
            return
