"""`zipage chat`: several concurrent chat sessions, with the engine's inner life beside them.

Each answer is submitted and streamed in a worker thread (an engine submit can wait for a step),
so the UI never blocks; the side panes redraw from `FrontDoor.snapshot()` a few times a second
and the event log drains `FrontDoor.subscribe()`.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane

from zipage.engine.api.handles import RequestHandle
from zipage.engine.api.protocol import FrontDoor
from zipage.engine.events import Compressed
from zipage.cli.console.plain_chat import SETTING_COMMANDS, Conversation, split_command
from zipage.cli.console.themes import ThemedApp, theme_names
from zipage.cli.console.fit import ItemsLine, longest_fitting
from zipage.cli.console.history_input import HistoryInput
from zipage.cli.console.kept_source import Holding, TokenBook, can_ask, prompt_tokens_of, take
from zipage.cli.console.kept_view import KEPT_HELP, KEPT_TERMS, KeptScreen
from zipage.cli.console.prob_source import AnswerScores, with_logprobs
from zipage.cli.console.prob_view import PROB_HELP, PROB_TERMS, ProbScreen
from zipage.cli.console.saved.browser import LIST_HELP, SavedChatsScreen
from zipage.cli.console.saved.export import export
from zipage.cli.console.saved.saver import ChatSaver
from zipage.cli.console.saved.store import SavedChatsError, SavedSession
from zipage.cli.console.widgets import (PANE_TERMS, BlockTable, ConfirmScreen, EnginePanes, HelpScreen, SidePanes, drain,
                                        printable, session_name_widget_id)

REFRESH_S = 0.25  # side panes redraw rate

STREAM_REDRAW_S = 0.05  # a streaming answer is redrawn at most this often
# The message box's hint, shorter where the box is narrow (a placeholder cannot wrap).
PLACEHOLDERS = ["Message (Enter sends · /help for commands · Ctrl+B sends to all sessions)",
                "Message (Enter sends · /help · Ctrl+B: all sessions)", "Message (Enter sends · /help)"]
FINISH_LABELS = {"stop": "finished", "length": "reached max tokens", "abort": "stopped"}

CHAT_COMMANDS = SETTING_COMMANDS + """
/all TEXT     send TEXT to every idle session at once (same as Ctrl+B)
/new [NAME]   open a session;  /close  close this one
/export PATH  write this session to PATH: Markdown, or JSON for a .json file
/theme [NAME] switch theme ({themes})"""


@dataclass
class Session:
    conv: Conversation
    view: VerticalScroll  # the transcript
    handle: RequestHandle | None = None
    last_request: int | None = None  # the latest answer's request, for the kept view
    kept: Holding | None = None  # what the kept view last showed of it (its KV is freed once it ends)
    busy: bool = False
    stop_requested: bool = False


def answer_meta(out, ended: float) -> str:
    """The line under an answer: tokens, time to first token (queueing and prefill) and decode speed
    apart, the prompt tokens the prefix cache served (a conversation's earlier turns), how it ended,
    and compression."""
    tokens = len(out.token_ids)
    parts = [f"{tokens} token{'s' if tokens != 1 else ''}"]
    first, arrival = out.metrics.get("first_token"), out.metrics.get("arrival")
    if first is not None and arrival is not None:
        parts.append(f"first token after {first - arrival:.2f} s")
        if tokens > 1 and ended > first:
            parts.append(f"then {(tokens - 1) / (ended - first):.1f} tok/s")
    cached = out.metrics.get("cached_prompt_tokens")
    prompt = len(out.prompt_token_ids) or out.metrics.get("prompt_tokens")  # an attached answer has no ids
    if cached:
        parts.append(f"{cached}{f' of {prompt}' if prompt else ''} prompt tokens cached")
    parts.append(FINISH_LABELS.get(out.finish_reason, out.finish_reason))
    squeezed = out.metrics.get("times_compressed", 0)
    if squeezed:
        parts.append(f"KV compressed {squeezed}×")
    return " · ".join(parts)


class Message(Static):
    """One turn. An answer is redrawn as its text streams in."""

    def __init__(self, text: str, classes: str):
        super().__init__(printable(text), classes=f"msg {classes}", markup=False)
        self.text = text

    def set_text(self, text: str) -> None:
        self.text = text
        self.update(Text(printable(text)))


class ChatApp(SidePanes, ThemedApp):
    TITLE = "Zipage chat"
    CSS = SidePanes.SIDE_CSS + """
    #main { width: 2fr; }
    #side { width: 1fr; min-width: 40; max-width: 64; }
    TabbedContent { height: 1fr; }
    TabPane { padding: 0; }
    .transcript { height: 1fr; padding: 0 1; }
    .msg { margin: 1 0 0 0; padding: 0 1; height: auto; }
    .msg-meta { margin: 0 0 0 2; height: auto; }
    .settings { height: auto; padding: 0 1; }
    #prompt { margin: 0 0; }
    #blocks { height: 1fr; min-height: 4; }
    #blocks-view { height: auto; }
    """
    ENABLE_COMMAND_PALETTE = False  # its theme picker would offer Textual's themes, which the stylesheet cannot read
    BINDINGS = [
        Binding("f1", "help", "Help", tooltip="Show keys and commands"),
        Binding("ctrl+n", "new_session", "New", tooltip="Open a new chat session"),
        # Not ctrl+w: the message box keeps it for deleting a word, as terminals do.
        Binding("alt+w", "close_session", "Close", tooltip="Close this session (asks first when it has history)"),
        Binding("ctrl+pagedown,alt+right", "next_session", "Next", tooltip="Switch to the next session"),
        Binding("ctrl+pageup,alt+left", "previous_session", "Previous", show=False,
                tooltip="Switch to the previous session"),
        Binding("ctrl+b", "broadcast", "Send to all", tooltip="Send the typed message to every idle session"),
        Binding("escape", "stop", "Stop answer", tooltip="Stop this session's running answer"),
        # Priority: the message box would take ctrl+c for copy.
        Binding("ctrl+c", "interrupt", "Stop/quit", show=False, priority=True,
                tooltip="Stop the running answer; with none running, press twice to quit"),
        ThemedApp.THEME_BINDING,
        SidePanes.SIDE_BINDING,
        # F3 works in every terminal; Alt+K arrives as ESC k where Alt is not a modifier (tmux).
        Binding("f3,alt+k", "kept", "Kept", tooltip=KEPT_HELP + " (the latest answer of this session)"),
        Binding("f4,alt+p", "probs", "Probs", tooltip=PROB_HELP + " (the latest answer of this session)"),
        Binding("ctrl+o,alt+o", "saved_chats", "Saved", show=False, tooltip=LIST_HELP),
        Binding("ctrl+q", "quit", "Quit", tooltip="Leave"),
    ]

    def __init__(self, engine: FrontDoor | Callable[[], FrontDoor], theme_name: str = "dark",
                 sessions: int = 1, temperature: float = 0.7, max_tokens: int = 512, system: str | None = None,
                 model_name: str = "the model", saver: ChatSaver | None = None, resume: list[SavedSession] = ()):
        """`engine` is a running engine, or a function that starts one: the app then draws first and
        calls it in a worker thread, showing progress while the model loads. `saver` keeps every session
        in the saved chats (none: nothing is saved); `resume`: saved sessions to open instead of new ones."""
        super().__init__(theme_name)
        self.engine: FrontDoor | None = None
        self.book: TokenBook | None = None  # the token ids of this app's requests, for the kept view
        self.start_engine = engine if callable(engine) else None
        self.model_name = model_name
        self.load_started = time.monotonic()
        self.load_error: str | None = None
        self.defaults = dict(temperature=temperature, max_tokens=max_tokens, system=system)
        self.initial_sessions = max(1, sessions)
        self.sessions: dict[str, Session] = {}  # by pane id
        self.events: queue.Queue | None = None
        self.counter = 0
        self.quit_armed = False  # a first ctrl+c with nothing to stop; a second one quits
        self.saver = saver or ChatSaver(None, model_name)
        self.saver.warn = lambda message: self.notify(message, severity="error", timeout=10)
        self.resume = list(resume)
        if self.start_engine is None:
            self.engine_ready(engine)

    def engine_ready(self, engine: FrontDoor) -> None:
        self.engine = engine
        self.book = TokenBook(engine)
        self.events = engine.subscribe()
        self.sub_title = f"{engine.config.model} · {engine.snapshot().device}"
        if self.is_running:  # loaded by the worker, after the first draw
            self.tabs.loading = False
            self.show_settings()
            self.refresh_bindings()  # the kept view's key shows once the engine can answer it

    def load_engine(self) -> None:
        """Worker thread: start the engine; a bad model or knob ends the app with its message."""
        try:
            engine = self.start_engine()
        except ValueError as e:
            self.load_error = str(e)
            self.call_from_thread(self.exit, None, 2)
            return
        if not self.is_running:  # the user left while the model loaded
            engine.close()
            return
        self.call_from_thread(self.engine_ready, engine)

    # -- layout --------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # Kept as attributes: timers and workers reach them even while the help screen is on top.
        self.tabs = TabbedContent(id="tabs")
        self.settings = ItemsLine(id="settings", classes="settings")
        self.prompt = HistoryInput(placeholder=PLACEHOLDERS[0], id="prompt")
        self.block_table = BlockTable(id="blocks-view")
        self.panes = EnginePanes()
        self.event_log, self.latency = self.panes.event_log, self.panes.latency
        yield Header(icon="▣")
        self.body = Horizontal(id="body")
        with self.body:
            with Vertical(id="main"):
                yield self.tabs
                yield self.settings
                yield self.prompt
            with Vertical(id="side", classes="side"):
                with VerticalScroll(id="blocks", classes="pane") as pane:
                    pane.border_title = "KV blocks per request"
                    yield self.block_table
                yield self.panes
        yield Footer()

    async def on_mount(self) -> None:
        for saved in self.resume:
            await self.resume_session(saved)
        for _ in range(0 if self.resume else self.initial_sessions):
            await self.open_session()
        self.tabs.active = next(iter(self.sessions))
        if self.engine is None:
            self.tabs.loading = True  # an animated indicator over the transcript while the model loads
            self.run_worker(self.load_engine, thread=True, group="load")
        self.set_interval(REFRESH_S, self.refresh_panes)
        self.prompt.focus()

    def on_unmount(self) -> None:
        if self.engine is None:
            return
        for session in self.sessions.values():
            if session.handle is not None:
                self.engine.abort(session.handle)
        self.engine.unsubscribe(self.events)

    # -- sessions ------------------------------------------------------------------
    @property
    def current(self) -> Session | None:
        return self.sessions.get(self.tabs.active)

    async def open_session(self, name: str | None = None) -> Session:
        self.counter += 1
        while not name and session_name_widget_id(f"chat-{self.counter}") in self.sessions:  # a resumed session has it
            self.counter += 1
        name = name or f"chat-{self.counter}"
        pane_id = session_name_widget_id(name)
        if pane_id in self.sessions:
            raise ValueError(f"a session named {name!r} is already open")
        session = Session(Conversation(name, **self.defaults), VerticalScroll(classes="transcript"))
        session.view.anchor()  # the newest message stays in view (through resizes too) until the user scrolls back
        self.sessions[pane_id] = session
        await self.tabs.add_pane(TabPane(name, session.view, id=pane_id))
        self.tabs.active = pane_id
        self.show_settings()
        return session

    async def action_new_session(self) -> None:
        await self.open_session()

    def action_close_session(self) -> None:
        """Close the current session; one with history or a running answer asks first."""
        pane_id = self.tabs.active
        session = self.sessions.get(pane_id)
        if session is None:
            return
        turns = len(session.conv.history) // 2
        if not turns and not session.busy:
            self.run_worker(self.close_session(pane_id))
            return
        lost = [f"{turns} turn{'s' if turns != 1 else ''}"] if turns and not self.saver.on else []
        lost += ["running answer"] if session.busy else []
        question = (f"Close {session.conv.name}? Its {' and '.join(lost)} will be lost." if lost else
                    f"Close {session.conv.name}? It stays in the saved chats (Ctrl+O reopens it).")

        async def answered(yes: bool | None) -> None:
            if yes:
                await self.close_session(pane_id)
        self.push_screen(ConfirmScreen(question), answered)

    async def close_session(self, pane_id: str) -> None:
        session = self.sessions.pop(pane_id, None)
        if session is None:
            return
        if session.handle is not None:
            self.engine.abort(session.handle)
        self.saver.closed(session.conv)
        await self.tabs.remove_pane(pane_id)
        if not self.sessions:
            await self.open_session()
        self.show_settings()

    def action_next_session(self, step: int = 1) -> None:
        ids = list(self.sessions)
        if ids:
            self.tabs.active = ids[(ids.index(self.tabs.active) + step) % len(ids)]
            self.show_settings()

    def action_previous_session(self) -> None:
        self.action_next_session(-1)

    def on_tabbed_content_tab_activated(self) -> None:
        self.show_settings()

    def on_resize(self) -> None:
        self.call_after_refresh(self.fit_placeholder)  # once the message box has its new width

    def action_toggle_side(self) -> None:
        super().action_toggle_side()
        self.call_after_refresh(self.fit_placeholder)

    def fit_placeholder(self) -> None:
        self.prompt.placeholder = longest_fitting(PLACEHOLDERS, self.prompt.content_size.width)

    def show_settings(self) -> None:
        session = self.current
        if session is None:
            return
        if self.engine is None:
            seconds = time.monotonic() - self.load_started
            self.settings.update(f"loading {self.model_name}… {seconds:.0f} s (the first run downloads it)")
            return
        state = "answering… (Esc stops)" if session.busy else "idle"
        self.settings.update(f"{session.conv.name}: {state} · {session.conv.settings_line()}")

    # -- input ---------------------------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        line = event.value.strip()
        self.prompt.remember(line)
        if line and not await self.run_line(line):
            return  # a refused message (its session still answering) stays in the box, to send later
        event.input.value = ""

    async def run_line(self, line: str) -> bool:
        """A message for the current session, or a slash command; False for a message that was
        refused (the notification says why)."""
        command, arg = split_command(line)
        session = self.current
        try:
            if not command:
                self.ask(session, line)
            elif command == "/all":
                self.broadcast(arg)
            elif command == "/new":
                await self.open_session(arg or None)
            elif command == "/close":
                self.action_close_session()
            elif command == "/theme":
                self.apply_theme(arg) if arg else self.action_cycle_theme()
            elif command == "/help":
                self.action_help()
            elif command == "/export":
                self.notify(export(self.saver.for_export(session.conv), arg or f"{session.conv.name}.md"), timeout=4)
            else:
                note = session.conv.apply(command, arg, self.engine)
                if note is None:
                    raise ValueError(f"unknown command {command}; F1 lists them")
                if command == "/clear":
                    self.saver.cleared(session.conv)
                else:
                    self.saver.settings(session.conv, self.position(session))
                self.notify(f"{session.conv.name}: {note}", timeout=2)
                self.show_settings()
        except ValueError as e:
            self.notify(str(e), severity="error")
            return bool(command)  # a refused command is short to type again; a message is kept
        return True

    def action_broadcast(self) -> None:
        text = self.prompt.value.strip()
        try:
            self.broadcast(text)
        except ValueError as e:  # nothing typed, or nobody idle: say so, keep the text
            self.notify(str(e), severity="error")
            return
        self.prompt.remember(text)
        self.prompt.value = ""

    def broadcast(self, text: str) -> None:
        if not text:
            raise ValueError("type a message first, then send it to all sessions")
        idle = [s for s in self.sessions.values() if not s.busy]
        if not idle:
            raise ValueError("every session is busy answering")
        for session in idle:
            self.ask(session, text)

    def action_stop(self) -> None:
        session = self.current
        if session is not None and session.busy:
            session.stop_requested = True
            if session.handle is not None:
                self.engine.abort(session.handle)

    def action_interrupt(self) -> None:
        """ctrl+c: stop the current answer; with nothing to stop, the second press quits."""
        session = self.current
        if session is not None and session.busy:
            self.action_stop()
            self.notify(f"{session.conv.name}: answer stopped", timeout=2)
        elif self.quit_armed:
            self.exit()
        else:
            self.quit_armed = True
            self.notify("press Ctrl+C again to quit (Ctrl+Q quits at once)", timeout=4)

    def on_input_changed(self) -> None:
        self.quit_armed = False  # typing in between starts the count again

    def action_help(self) -> None:
        notes = ("Commands (type in the message box):\n" + CHAT_COMMANDS.format(themes=", ".join(theme_names()))
                 + "\n\nThe side panes: each request's KV blocks (glyph = role), throughput, the pool and "
                 "memory gauges, latency and the engine's events.\n\n" + PANE_TERMS + "\n\n" + KEPT_TERMS
                 + "\n\n" + PROB_TERMS)
        keys = self.BINDINGS[:-1] + HistoryInput.BINDINGS + self.BINDINGS[-1:]  # ↑/↓ belong to the message box
        self.push_screen(HelpScreen("Zipage chat: keys", keys, notes))

    # -- answering -----------------------------------------------------------------
    def ask(self, session: Session, prompt: str) -> None:
        if self.engine is None:
            raise ValueError(f"{self.model_name} is still loading; send the message once it is ready")
        if session.busy:
            raise ValueError(f"{session.conv.name} is still answering; Esc stops it")
        self.saver.sent(session.conv, prompt, self.position(session))  # kept even if the app dies before the answer
        session.view.mount(Message(prompt, "msg-user"))
        reply = Message("…", "msg-assistant")
        session.view.mount(reply)
        session.view.scroll_end(animate=False)
        session.view.anchor()  # a new question follows its answer again, even after scrolling back
        session.busy, session.stop_requested = True, False
        self.quit_armed = False
        self.show_settings()
        self.run_worker(lambda: self.stream(session, prompt, reply), thread=True, group="answers")

    def stream(self, session: Session, prompt: str, reply: Message) -> None:
        """Worker thread: submit, then push the growing text to the UI a few dozen times a second."""
        try:
            # Every answer asks for its logprobs, for the probability view (prob_source.py: the cost).
            handle = self.book.submit(session.conv.messages_for(prompt), with_logprobs(session.conv.params()),
                                      session=session.conv.name)
        except (ValueError, RuntimeError) as e:
            self.call_from_thread(self.finish, session, prompt, reply, None, session.conv.refusal(e), time.monotonic(), "")
            return
        session.handle, session.last_request = handle, handle.id
        if session.stop_requested:  # Esc arrived while the submit was in flight
            self.engine.abort(handle)
        text, drawn = "", 0.0
        for delta in handle:
            text += delta
            if time.monotonic() - drawn >= STREAM_REDRAW_S:
                drawn = time.monotonic()
                self.call_from_thread(self.show_partial, reply, text)
        self.call_from_thread(self.finish, session, prompt, reply, handle, None, time.monotonic(), text)

    def show_partial(self, reply: Message, text: str) -> None:
        if not reply.is_attached:  # the session was closed meanwhile
            return
        reply.set_text(text)  # the anchored transcript follows it unless the user scrolled back

    def finish(self, session: Session, prompt: str, reply: Message, handle: RequestHandle | None,
               error: str | None, ended: float, streamed: str) -> None:
        session.busy, session.handle = False, None
        out = handle.result() if handle is not None else None
        if out is not None and out.finish_reason == "error":
            error = out.error
        if not reply.is_attached:  # the session was closed meanwhile
            return
        if error is not None:
            self.show_failure(reply, streamed, error)
        else:
            reply.set_text(out.text or "(empty answer)")
            session.conv.record(prompt, out.text)
            meta = answer_meta(out, ended)
            self.saver.answered(session.conv, out.text, meta, self.position(session))
            reply.parent.mount(ItemsLine(meta, classes="msg-meta"), after=reply)
        self.show_settings()

    @staticmethod
    def show_failure(reply: Message, streamed: str, error: str) -> None:
        """What streamed before the failure stays on screen. The turn is not recorded, so the next
        message does not build on a broken answer, and ↑ recalls this one to send it again."""
        note = f"error: {error}\nNot kept in the conversation: ↑ recalls your message to send it again."
        if streamed:
            reply.set_text(streamed)
            reply.parent.mount(Message(note, "msg-error"), after=reply)
        else:
            reply.set_text(note)
            reply.set_classes("msg msg-error")

    # -- saved chats ---------------------------------------------------------------
    def position(self, session: Session) -> int:
        """The session's tab's place, which a resumed chat keeps."""
        return next((i for i, s in enumerate(self.sessions.values()) if s is session), len(self.sessions))

    async def resume_session(self, saved: SavedSession) -> None:
        """Open a saved session in a new tab: its settings, history and transcript as they were."""
        name, copy = saved.name, 1
        while session_name_widget_id(name) in self.sessions:  # another run's session of the same name is open
            copy += 1
            name = f"{saved.name}-{copy}"
        session = await self.open_session(name)
        self.saver.resumed(session.conv, saved, self.position(session))
        for i, m in enumerate(saved.messages):
            if m.role == "user":
                session.view.mount(Message(m.content, "msg-user"))
            else:
                session.view.mount(Message(m.content or "(empty answer)", "msg-assistant"))
            if m.meta:
                session.view.mount(ItemsLine(m.meta, classes="msg-meta"))
            unanswered = m.role == "user" and (i + 1 == len(saved.messages) or saved.messages[i + 1].role == "user")
            if unanswered:
                session.view.mount(Message("No answer was saved: it had not ended when the chat closed, or it "
                                           "failed. ↑ recalls the message to send it again.", "msg-error"))
                self.prompt.remember(m.content)
        self.show_settings()

    def action_saved_chats(self) -> None:
        if not self.saver.on:
            self.notify("saving is off in this chat (--no-save)", timeout=3)
            return
        try:
            listed = self.saver.store.sessions()
        except SavedChatsError as e:
            self.notify(str(e), severity="error")
            return
        open_ids = {s.conv.saved_id for s in self.sessions.values()}

        async def chosen(number: int | None) -> None:
            if number is None:
                return
            here = next((pane for pane, s in self.sessions.items() if s.conv.saved_id == number), None)
            if here is not None:
                self.tabs.active = here
            else:
                try:
                    await self.resume_session(self.saver.store.find(str(number)))
                except SavedChatsError as e:
                    self.notify(str(e), severity="error")
        self.push_screen(SavedChatsScreen(listed, open_ids, str(self.saver.store.path)), chosen)

    # -- the kept view -------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """The kept view's key shows (and works) only with an engine that answers the kept query."""
        if action == "kept":
            return self.engine is not None and can_ask(self.engine)
        if action == "probs":
            return self.engine is not None
        return True

    def action_probs(self) -> None:
        session = self.current
        if session is None or session.last_request is None:
            self.notify("ask something first: the view shows how likely each token of an answer was", timeout=3)
            return
        request = session.last_request
        self.push_screen(ProbScreen(f"#{request} ({session.conv.name})",
                                    AnswerScores(self.engine, self.book, request)))

    def action_kept(self) -> None:
        session = self.current
        if session is None or session.last_request is None:
            self.notify("ask something first: the view shows what an answer's request still holds", timeout=3)
            return
        request = session.last_request
        engine, book = self.engine, self.book
        remembered = session.kept is not None and session.kept.request == request
        if not remembered and not session.busy:  # ended, and no compression of it took a map
            self.notify(f"#{request} was never compressed: the answer fit its KV budget, held every token, and "
                        "its KV was freed when it ended. Ask for a longer answer, or lower the budget with "
                        "/budget, to watch a compression.", timeout=6)
            return

        def closed(holding: Holding | None) -> None:
            session.kept = holding or session.kept

        self.push_screen(KeptScreen(request, f"#{request} ({session.conv.name})",
                                    lambda: take(engine, book, request, prompt_tokens_of(engine, request)),
                                    last=session.kept), closed)

    def remember_compressed(self, events) -> None:
        """After each compression of a session's answer, take its map in the background: once the
        answer ends its KV is freed, and the view then shows this last map instead of nothing."""
        if self.engine is None or not can_ask(self.engine):
            return
        for event in events:
            if not isinstance(event, Compressed):
                continue
            for session in self.sessions.values():
                if session.last_request == event.request:
                    self.run_worker(lambda s=session, r=event.request: self._remember(s, r), thread=True,
                                    group="kept-memory")

    def _remember(self, session: Session, request: int) -> None:
        holding = take(self.engine, self.book, request, prompt_tokens_of(self.engine, request))
        if isinstance(holding, Holding) and session.last_request == request:
            session.kept = holding

    # -- live panes ----------------------------------------------------------------
    def refresh_panes(self) -> None:
        if not self.screen_stack:  # the app is closing: its screens are gone, its timer not yet stopped
            return
        if self.engine is None:
            self.show_settings()  # the loading time ticks
            return
        snapshot = self.engine.snapshot()
        events = drain(self.events)
        if isinstance(self.screen, KeptScreen):
            self.screen.engine_events(events)
        self.remember_compressed(events)
        self.block_table.show(snapshot)
        self.panes.show(snapshot, events)
        running = sum(1 for s in self.sessions.values() if s.busy)
        count = len(self.sessions)
        problem = self.connection_problem(self.engine)
        self.sub_title = ((f"{problem} · last known: " if problem else "")
                          + f"{snapshot.model} · {snapshot.device} · {count} session{'s' if count != 1 else ''}, "
                          f"{running} answering · step {snapshot.step}")
