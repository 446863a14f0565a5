"""Lines that fit their pane. A line of items ("12 tokens · first token after 0.31 s · …") breaks only
between items, so a figure never lands on a line apart from its label; a hint that cannot fit gives
way to a shorter wording of itself rather than being cut."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import Static

SEPARATOR = " · "


def wrap_items(items: list[Text | str], width: int, separator: str = SEPARATOR, style: str = "") -> Text:
    """The items joined by `separator`, a line break in its place wherever the next item would not fit
    in `width` cells. An item wider than a whole line is left for the renderer to wrap by words."""
    text, column = Text(), 0
    for item in items:
        item = Text(item) if isinstance(item, str) else item
        if column and column + cell_len(separator) + item.cell_len > width:
            text.append("\n")
            column = 0
        elif column:
            text.append(separator, style)
            column += cell_len(separator)
        text.append_text(item)
        column += item.cell_len
    return text


def longest_fitting(variants: list[str], width: int) -> str:
    """The first (longest) of the wordings that fits in `width` cells, else the last (shortest)."""
    return next((v for v in variants if cell_len(v) <= width), variants[-1])


class ItemsLine(Static):
    """A line of " · "-separated items (an answer's figures, a session's settings, a pane's keys),
    wrapped between items at the widget's width. `text` is the line as one string; `shorter` wordings
    of it stand in where it would not fit on one line."""

    DEFAULT_CSS = "ItemsLine { height: auto; }"

    def __init__(self, text: str = "", shorter: tuple[str, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.text, self.shorter = text, shorter

    def update(self, text: str = "") -> None:
        self.text = str(text)
        self.refresh(layout=True)

    def shown(self, width: int) -> str:
        """The wording drawn at this width."""
        return longest_fitting([self.text, *self.shorter], width) if self.shorter else self.text

    def wrapped(self, width: int) -> Text:
        width = max(1, width)
        return wrap_items(self.shown(width).split(SEPARATOR), width)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.wrapped(width).wrap(self.app.console, max(1, width)))

    def render(self) -> Text:
        return self.wrapped(self.content_size.width)
