"""The saved-chats file: sessions, their settings and their messages in one SQLite database.

Every write is one transaction that commits before the call returns, so a crash (or a killed
terminal) loses at most the answer that was streaming. The file carries a schema version
(`PRAGMA user_version`); a file this code cannot read (not SQLite, damaged, or written by a newer
Zipage) is refused with a SavedChatsError that says what to do, never a traceback.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
FILE_NAME = "chats.sqlite3"

SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    started REAL NOT NULL,
    model TEXT NOT NULL
);
CREATE TABLE sessions (
    id INTEGER PRIMARY KEY,
    run INTEGER NOT NULL REFERENCES runs(id),
    position INTEGER NOT NULL,         -- its tab's place in its run
    name TEXT NOT NULL,
    temperature REAL NOT NULL,
    max_tokens INTEGER NOT NULL,
    system TEXT,
    kv_budget INTEGER,
    open INTEGER NOT NULL DEFAULT 1,   -- 0 once closed in the app: --resume alone leaves it closed
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    session INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    meta TEXT,                         -- an answer's line of figures, as the chat showed it
    created REAL NOT NULL
);
CREATE INDEX messages_by_session ON messages(session, id);
"""


def data_dir() -> Path:
    """Where Zipage keeps what the user made (not a cache: nothing here can be fetched again):
    $ZIPAGE_DATA, else $XDG_DATA_HOME/zipage, else ~/.local/share/zipage."""
    if os.environ.get("ZIPAGE_DATA"):
        return Path(os.environ["ZIPAGE_DATA"]).expanduser()
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share").expanduser() / "zipage"


def default_path() -> Path:
    return data_dir() / FILE_NAME


class SavedChatsError(ValueError):
    """The saved chats cannot be read or written; the message says why and what to do."""


@dataclass
class SavedMessage:
    role: str  # "user" or "assistant"
    content: str
    created: float
    meta: str | None = None


@dataclass
class SavedSession:
    id: int | None  # None: a conversation that was never saved (exported from memory)
    name: str
    model: str
    temperature: float
    max_tokens: int
    system: str | None = None
    kv_budget: int | None = None
    run: int | None = None
    position: int = 0
    open: bool = True
    created: float = 0.0
    updated: float = 0.0
    messages: list[SavedMessage] = field(default_factory=list)
    turns: int = 0  # answered questions (filled by listings, which load no messages)
    first_question: str = ""

    def history(self) -> list[dict]:
        """The conversation as the model is sent it: each question with its answer. A question whose
        answer never came (the app closed, or the answer failed) is not part of it."""
        pairs = []
        for question, answer in zip(self.messages, self.messages[1:]):
            if question.role == "user" and answer.role == "assistant":
                pairs += [{"role": "user", "content": question.content},
                          {"role": "assistant", "content": answer.content}]
        return pairs


class ChatStore:
    """One saved-chats file. Calls come from the chat's UI thread; a lock keeps them whole anyway."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise SavedChatsError(f"cannot open the saved chats at {self.path}: {e}. "
                                  "Set ZIPAGE_DATA to another folder, or chat with --no-save") from None
        try:
            self._prepare()
        except BaseException:
            self.db.close()
            raise

    def _prepare(self) -> None:
        """Create the tables in a new file; refuse a file that is not ours, damaged, or newer."""
        try:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if version > SCHEMA_VERSION:
                raise SavedChatsError(
                    f"the saved chats at {self.path} were written by a newer Zipage (schema {version}; this one "
                    f"reads {SCHEMA_VERSION}). Upgrade Zipage, set ZIPAGE_DATA to another folder, or chat with "
                    "--no-save")
            if version == 0 and tables:
                raise SavedChatsError(f"{self.path} is an SQLite file, but not Zipage's saved chats: move it "
                                      "aside, set ZIPAGE_DATA to another folder, or chat with --no-save")
            self.db.execute("PRAGMA foreign_keys = ON")
            if version == 0:
                with self._transaction() as db:
                    if db.execute("PRAGMA user_version").fetchone()[0] == 0:  # not made meanwhile by another chat
                        for statement in SCHEMA.split(";"):
                            db.execute(statement)
                        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self.db.execute("SELECT count(*) FROM sessions JOIN messages ON messages.session = sessions.id").fetchone()
        except sqlite3.DatabaseError as e:
            raise SavedChatsError(f"the saved chats at {self.path} cannot be read ({e}): the file is damaged or "
                                  "not a database. Move it aside (a new one is made), or chat with --no-save") from None

    def _transaction(self):
        return _Transaction(self)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- writing -------------------------------------------------------------------------
    def new_run(self, model: str) -> int:
        with self._transaction() as db:
            return db.execute("INSERT INTO runs (started, model) VALUES (?, ?)", (time.time(), model)).lastrowid

    def new_session(self, run: int, position: int, name: str, temperature: float, max_tokens: int,
                    system: str | None, kv_budget: int | None) -> int:
        now = time.time()
        with self._transaction() as db:
            return db.execute(
                "INSERT INTO sessions (run, position, name, temperature, max_tokens, system, kv_budget, created, "
                "updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run, position, name, temperature, max_tokens, system, kv_budget, now, now)).lastrowid

    def save_settings(self, session: int, temperature: float, max_tokens: int, system: str | None,
                      kv_budget: int | None) -> None:
        with self._transaction() as db:
            db.execute("UPDATE sessions SET temperature = ?, max_tokens = ?, system = ?, kv_budget = ?, updated = ? "
                       "WHERE id = ?", (temperature, max_tokens, system, kv_budget, time.time(), session))

    def add_message(self, session: int, role: str, content: str, meta: str | None = None) -> None:
        now = time.time()
        with self._transaction() as db:
            db.execute("INSERT INTO messages (session, role, content, meta, created) VALUES (?, ?, ?, ?, ?)",
                       (session, role, content, meta, now))
            db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session))

    def clear(self, session: int) -> None:
        """`/clear` forgets the history, here too."""
        with self._transaction() as db:
            db.execute("DELETE FROM messages WHERE session = ?", (session,))
            db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session))

    def set_open(self, session: int, is_open: bool) -> None:
        with self._transaction() as db:
            db.execute("UPDATE sessions SET open = ? WHERE id = ?", (int(is_open), session))

    def move(self, session: int, run: int, position: int) -> None:
        """A resumed session belongs to the run that reopened it, so the next --resume finds it there."""
        with self._transaction() as db:
            db.execute("UPDATE sessions SET run = ?, position = ?, open = 1 WHERE id = ?", (run, position, session))

    # -- reading -------------------------------------------------------------------------
    LISTING = """
        SELECT s.id, s.name, r.model, s.temperature, s.max_tokens, s.system, s.kv_budget, s.run, s.position,
               s.open, s.created, s.updated,
               (SELECT count(*) FROM messages m WHERE m.session = s.id AND m.role = 'assistant'),
               coalesce((SELECT content FROM messages m WHERE m.session = s.id AND m.role = 'user'
                         ORDER BY m.id LIMIT 1), '')
        FROM sessions s JOIN runs r ON r.id = s.run"""

    def sessions(self) -> list[SavedSession]:
        """Every saved session, the most recently used first (messages not loaded)."""
        return self._listing(" ORDER BY s.updated DESC, s.id DESC", ())

    def last_run(self) -> list[SavedSession]:
        """What the last chat left open (the newest run with an open session), in its tabs' order, messages
        loaded."""
        found = self._listing(" WHERE s.open = 1 AND s.run = (SELECT max(run) FROM sessions WHERE open = 1)"
                              " ORDER BY s.position, s.id", ())
        return [self.load(s.id) for s in found]

    def find(self, ref: str) -> SavedSession:
        """A session by its number, else the newest one of that name (messages loaded)."""
        ref = ref.strip()
        found = self._listing(" WHERE s.id = ?", (int(ref),)) if ref.isdecimal() else []
        found = found or self._listing(" WHERE s.name = ? ORDER BY s.updated DESC, s.id DESC LIMIT 1", (ref,))
        if not found:
            raise SavedChatsError(f"no saved chat {ref!r}: `zipage chat --list-saved` shows them")
        return self.load(found[0].id)

    def load(self, session: int) -> SavedSession:
        (found,) = self._listing(" WHERE s.id = ?", (session,))
        with self.lock:
            rows = self._read(lambda: self.db.execute(
                "SELECT role, content, created, meta FROM messages WHERE session = ? ORDER BY id", (session,)).fetchall())
        found.messages = [SavedMessage(*row) for row in rows]
        return found

    def _listing(self, where: str, args: tuple) -> list[SavedSession]:
        with self.lock:
            rows = self._read(lambda: self.db.execute(self.LISTING + where, args).fetchall())
        return [SavedSession(id=r[0], name=r[1], model=r[2], temperature=r[3], max_tokens=r[4], system=r[5],
                             kv_budget=r[6], run=r[7], position=r[8], open=bool(r[9]), created=r[10], updated=r[11],
                             turns=r[12], first_question=r[13]) for r in rows]

    def _read(self, query):
        try:
            return query()
        except sqlite3.Error as e:
            raise SavedChatsError(f"cannot read the saved chats at {self.path}: {e}") from None


class _Transaction:
    """`with store._transaction() as db:` one committed transaction, or none of it; errors as SavedChatsError."""

    def __init__(self, store: ChatStore):
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store.lock.acquire()
        try:
            self.store.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            self.store.lock.release()
            raise SavedChatsError(f"cannot write the saved chats at {self.store.path}: {e}") from None
        return self.store.db

    def __exit__(self, kind, error, trace) -> bool:
        try:
            self.store.db.execute("ROLLBACK" if kind else "COMMIT")
        except sqlite3.Error as e:
            if kind is None:
                raise SavedChatsError(f"cannot write the saved chats at {self.store.path}: {e}") from None
        finally:
            self.store.lock.release()
        if kind is not None and issubclass(kind, sqlite3.Error):
            raise SavedChatsError(f"cannot write the saved chats at {self.store.path}: {error}") from None
        return False
