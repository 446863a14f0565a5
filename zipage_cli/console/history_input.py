"""An Input whose ↑/↓ recall the lines sent earlier, as a shell or `zipage chat --plain` does."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.widgets import Input


class HistoryInput(Input):
    """↑ steps back through the sent lines, ↓ forward again; past the newest, the draft typed
    before the recall comes back."""

    BINDINGS = [
        Binding("up", "recall(-1)", "Earlier message", show=False,
                tooltip="Recall an earlier message you sent"),
        Binding("down", "recall(1)", "Later message", show=False,
                tooltip="Step forward again, back to the message being typed"),
    ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []
        self.position = 0  # index into `sent`; len(sent) means "the draft"
        self.draft = ""

    async def _on_key(self, event: events.Key) -> None:
        """An Alt chord is a command, never text. A terminal (and tmux) sends Alt+W as ESC then w,
        which Textual reads as alt+w but Input would type as "w": here the app's bindings get it."""
        if event.key.startswith("alt+"):
            event.prevent_default()
            return
        await super()._on_key(event)

    def remember(self, line: str) -> None:
        if line and (not self.sent or self.sent[-1] != line):
            self.sent.append(line)
        self.position, self.draft = len(self.sent), ""

    def action_recall(self, step: int) -> None:
        if not self.sent:
            return
        if self.position == len(self.sent):
            self.draft = self.value
        self.position = max(0, min(len(self.sent), self.position + step))
        self.value = self.sent[self.position] if self.position < len(self.sent) else self.draft
        self.cursor_position = len(self.value)
