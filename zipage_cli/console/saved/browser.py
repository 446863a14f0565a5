"""The saved-chats list in `zipage chat` (Ctrl+O): every saved session, the most recent first; Enter
opens the highlighted one in a tab of its own, Esc closes the list."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from zipage.cli.console.saved.store import SavedSession

LIST_HELP = "List the saved chats; Enter reopens one in a new tab (zipage chat --resume reopens them at start)"


def when(seconds: float, now: float | None = None) -> str:
    """A short time: the hour today, else the date."""
    now = time.time() if now is None else now
    same_day = time.localtime(seconds)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d", time.localtime(seconds))


def one_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def listing_rows(sessions: list[SavedSession], open_ids: set[int]) -> list[tuple]:
    """(number, name, turns, last used, first question) per session; `*` marks those open in this chat.
    What the user wrote is Text, so that no bracket in it is read as markup."""
    return [(str(s.id), Text(s.name + (" *" if s.id in open_ids else "")), str(s.turns), when(s.updated),
             Text(one_line(s.first_question, 48) or "-")) for s in sessions]


class SavedChatsScreen(ModalScreen[int | None]):
    """Dismissed with the chosen session's number, or None."""

    BINDINGS = [Binding("escape,ctrl+o,alt+o", "dismiss_list", "Close")]  # Enter: the table's own
    DEFAULT_CSS = """
    SavedChatsScreen { align: center middle; }
    SavedChatsScreen #saved-box { width: 90%; max-width: 110; height: 80%; }
    SavedChatsScreen #saved-hints { height: auto; }
    SavedChatsScreen DataTable { height: 1fr; }
    """

    def __init__(self, sessions: list[SavedSession], open_ids: set[int], where: str):
        super().__init__()
        self.sessions, self.open_ids, self.where = sessions, open_ids, where

    def compose(self) -> ComposeResult:
        table = DataTable(cursor_type="row", zebra_stripes=True)
        table.add_columns("#", "name", "turns", "last used", "first question")
        for row in listing_rows(self.sessions, self.open_ids):
            table.add_row(*row, key=row[0])
        hints = ("Enter: open in a new tab (or go to it; * = open here) · Esc: close"
                 if self.sessions else "No saved chats yet: every session is saved as you chat.")
        with Vertical(id="saved-box", classes="pane") as box:
            box.border_title = "Saved chats"
            box.border_subtitle = self.where
            yield Static(hints, id="saved-hints")
            yield table

    def action_choose(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            self.dismiss(int(table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value))

    def on_data_table_row_selected(self) -> None:  # a click, or Enter inside the table
        self.action_choose()

    def action_dismiss_list(self) -> None:
        self.dismiss(None)
