"""The saved chats on the command line: what `zipage chat --resume` reopens, `--list-saved` and `--export`.
Every problem is a SavedChatsError (a ValueError), which the command line reports in one line."""

from __future__ import annotations

from typing import TextIO

from rich.table import Table

from zipage.cli.console.saved.browser import listing_rows
from zipage.cli.console.saved.export import export, to_markdown
from zipage.cli.console.saved.store import ChatStore, SavedChatsError, SavedSession


def to_resume(store: ChatStore, ref: str | None) -> list[SavedSession]:
    """`--resume`: the one session `ref` names (number or name), or without one the sessions the last chat
    left open."""
    if ref is not None:
        return [store.find(ref)]
    sessions = store.last_run()
    if not sessions:
        raise SavedChatsError(f"nothing to resume: no saved chat left a session open ({store.path}). "
                              "`zipage chat --list-saved` shows every saved session; --resume NUMBER opens one")
    return sessions


def listing(store: ChatStore) -> Table:
    table = Table(title=f"Saved chats ({store.path})", caption="zipage chat --resume NUMBER reopens one")
    for column in ("#", "name", "turns", "last used", "first question"):
        table.add_column(column, justify="right" if column in ("#", "turns") else "left")
    for row in listing_rows(store.sessions(), set()):
        table.add_row(*row)
    return table


def export_saved(store: ChatStore, ref: str, output: str | None, stdout: TextIO) -> str | None:
    """`--export SESSION [--output PATH]`: the session as Markdown on `stdout`, or written to PATH (JSON for
    a .json file); then what was written, in words."""
    session = store.find(ref)
    if output is None:
        stdout.write(to_markdown(session))
        return None
    return export(session, output)
