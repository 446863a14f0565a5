"""What a chat tells its saved-chats file, as it happens: a question when it is sent, an answer when it
ends, new settings, /clear, a closed session, a session resumed.

A session (and the run it belongs to) is written when it first has something to keep, so a chat that
never says anything leaves nothing behind. A write that fails is said once, through `warn`, and the chat
goes on unsaved: losing the file must never stop a conversation.
"""

from __future__ import annotations

from typing import Callable

from zipage.cli.console.saved.store import ChatStore, SavedChatsError, SavedMessage, SavedSession


class ChatSaver:
    """Each `conv` is a chat session's Conversation (plain_chat.py); its `saved_id` is set once saved."""

    def __init__(self, store: ChatStore | None, model: str, warn: Callable[[str], None] = lambda message: None):
        """`store` None: saving is off, and every call does nothing."""
        self.store, self.model, self.warn = store, model, warn
        self.run: int | None = None  # this chat's run, once it saved anything

    @property
    def on(self) -> bool:
        return self.store is not None

    def sent(self, conv, prompt: str, position: int) -> None:
        self._write(lambda: self.store.add_message(self._session(conv, position), "user", prompt))

    def answered(self, conv, answer: str, meta: str | None, position: int) -> None:
        self._write(lambda: self.store.add_message(self._session(conv, position), "assistant", answer, meta))

    def settings(self, conv, position: int) -> None:
        def save():
            if conv.saved_id is None:
                self._session(conv, position)  # written with its settings
            else:
                self.store.save_settings(conv.saved_id, conv.temperature, conv.max_tokens, conv.system,
                                         conv.kv_budget)
        self._write(save)

    def cleared(self, conv) -> None:
        if conv.saved_id is not None:
            self._write(lambda: self.store.clear(conv.saved_id))

    def closed(self, conv) -> None:
        if conv.saved_id is not None:
            self._write(lambda: self.store.set_open(conv.saved_id, False))

    def resumed(self, conv, saved: SavedSession, position: int) -> None:
        """Give `conv` the saved session's settings and history; the session now belongs to this run."""
        conv.temperature, conv.max_tokens = saved.temperature, saved.max_tokens
        conv.system, conv.kv_budget = saved.system, saved.kv_budget
        conv.history = saved.history()
        conv.saved_id = saved.id
        self._write(lambda: self.store.move(saved.id, self._run(), position))

    def for_export(self, conv) -> SavedSession:
        """The session as saved (answers' figures and unanswered questions included), or as held in
        memory where it was never saved."""
        if self.store is not None and conv.saved_id is not None:
            try:
                return self.store.load(conv.saved_id)
            except SavedChatsError:
                pass  # what memory holds is still worth exporting
        return SavedSession(None, conv.name, self.model, conv.temperature, conv.max_tokens, conv.system,
                            conv.kv_budget, messages=[SavedMessage(m["role"], m["content"], 0.0)
                                                      for m in conv.history])

    def _run(self) -> int:
        if self.run is None:
            self.run = self.store.new_run(self.model)
        return self.run

    def _session(self, conv, position: int) -> int:
        if conv.saved_id is None:
            conv.saved_id = self.store.new_session(self._run(), position, conv.name, conv.temperature,
                                                   conv.max_tokens, conv.system, conv.kv_budget)
        return conv.saved_id

    def _write(self, write: Callable[[], None]) -> None:
        if self.store is None:
            return
        try:
            write()
        except SavedChatsError as e:
            self.store = None  # said once; the chat goes on unsaved
            self.warn(f"{e}. This chat is no longer being saved.")
