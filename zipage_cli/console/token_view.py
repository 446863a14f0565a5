"""The token-cursor screen that the kept view and the probability view share: a text laid out token by
token, each token shaded by its level, a cursor moved by keys and clicks, a head with the levels'
legend, and a pane on the token under the cursor. Each view brings its levels (a `Shading`), its data
and its words (kept_view.py, prob_view.py; docs/design-notes.md, "What a request still holds" and
"Log-probabilities").
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from zipage.cli.console.widgets import printable

UNKNOWN = "▫"  # a token without text of its own: it starts a character that a later token ends
UNSEEN = "█"  # a token whose text is unknown here: one cell, where the text draws its level's glyph
ANSWER_LABEL = "── answer ──"
# The cursor's keys; each view puts its own keys to close it first.
CURSOR_BINDINGS = [
    Binding("left", "move(-1)", "Previous token", show=False),
    Binding("right", "move(1)", "Next token", show=False),
    Binding("up", "line(-1)", "Line up", show=False),
    Binding("down", "line(1)", "Line down", show=False),
    Binding("home", "jump(0)", "First token", show=False),
    Binding("end", "jump(-1)", "Last token", show=False),
]


@dataclass(frozen=True, eq=False)
class Shading:
    """A view's levels, least first, with their glyphs (the text reads without colour too) and legend
    labels. Their looks are the theme's component classes `<name>--<level>` and `<name>--cursor`
    (themes/console.tcss); `name` also starts the ids of the view's parts."""

    name: str
    levels: tuple[str, ...]
    glyphs: dict[str, str]
    labels: dict[str, str]

    def classes(self) -> set[str]:
        return {f"{self.name}--{level}" for level in self.levels} | {f"{self.name}--cursor", "dim"}


class Styled(Static):
    """Base of a view's widgets: a view's subclass names its `SHADING`, whose classes become its
    COMPONENT_CLASSES, so that the theme's looks (rules on that subclass's name) reach `style_for`."""

    SHADING: Shading

    def __init_subclass__(cls, **kwargs):
        if "SHADING" in cls.__dict__:
            cls.COMPONENT_CLASSES = cls.SHADING.classes()
        super().__init_subclass__(**kwargs)

    def style_for(self, name: str):
        return self.get_component_rich_style(name, partial=True)

    def legend(self) -> Text:
        """Each level's glyph and label in its look, the highest first."""
        text = Text(no_wrap=True, overflow="ellipsis")
        for name in reversed(self.SHADING.levels):
            style = self.style_for(f"{self.SHADING.name}--{name}")
            text.append(self.SHADING.glyphs[name], style)
            text.append(" ")
            text.append(self.SHADING.labels[name], style)
            text.append("  ")
        return text


# -- the text -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    position: int | None  # None: a label (the answer's start)
    column: int
    text: str


def shown(piece: str | None) -> tuple[str, bool]:
    """A token as drawn, and whether a line break follows it: newlines become ↵ (then a break), tabs ⇥.
    A token without text of its own (it starts a character) is ▫; one whose text is unknown here is one
    cell (UNSEEN)."""
    if piece is None:
        return UNSEEN, False
    if not piece:
        return UNKNOWN, False
    text = printable(piece).replace("\t", "⇥")
    return text.replace("\n", "↵"), "\n" in piece


def layout(pieces: list[str | None], width: int, answer_from: int | None) -> list[list[Segment]]:
    """Lines of segments: tokens wrap between tokens (a token wider than a line is cut), a token with a
    newline ends its line, and the answer starts on a line of its own under a label."""
    width = max(4, width)
    lines: list[list[Segment]] = [[]]
    column = 0

    def new_line():
        nonlocal column
        lines.append([])
        column = 0

    for position, piece in enumerate(pieces):
        if position == answer_from and position > 0:
            if lines[-1]:
                new_line()
            lines[-1].append(Segment(None, 0, ANSWER_LABEL))
            new_line()
        text, breaks = shown(piece)
        while text:
            room = width - column
            if cell_len(text) > room and column:
                new_line()
                continue
            part = text
            while cell_len(part) > room:
                part = part[:-1]
            part = part or text[0]
            lines[-1].append(Segment(position, column, part))
            column += cell_len(part)
            text = text[len(part):]
            if text:
                new_line()
        if breaks:
            new_line()
    if not lines[-1] and len(lines) > 1:
        lines.pop()
    return lines


class TokenText(Styled):
    """The text, each token in its level's look (its glyph where its text is unknown), the cursor's token
    marked; walked line by line and clicked. A view's subclass puts its own Styled base first (Textual
    takes a widget's CSS, the theme's looks, from its first base) and gives `show_text` its data."""

    CURSOR_OVER = Style()  # laid over the cursor's look

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pieces: list[str | None] | None = None
        self.levels: list[str] = []  # each token's level
        self.answer_from: int | None = None
        self.cursor = 0
        self._lines: tuple[int, list[list[Segment]]] | None = None  # (width, lines)

    def show_text(self, pieces: list[str | None], levels: list[str], answer_from: int | None = None) -> None:
        """Draw these tokens in these levels (laid out again only when the tokens are others)."""
        if pieces is not self.pieces or answer_from != self.answer_from:
            self._lines = None
        self.pieces, self.levels, self.answer_from = pieces, levels, answer_from
        self.refresh(layout=True)

    def lines(self, width: int | None = None) -> list[list[Segment]]:
        width = self.content_size.width if width is None else width
        if self._lines is None or self._lines[0] != width:
            self._lines = (width, layout(self.pieces, width, self.answer_from) if self.pieces is not None else [])
        return self._lines[1]

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, len(self.lines(width)))

    def line_of(self, position: int) -> int:
        for y, line in enumerate(self.lines()):
            if any(s.position == position for s in line):
                return y
        return 0

    def at(self, x: int, y: int) -> int | None:
        """The token drawn at (x, y), or the nearest one on that line."""
        lines = self.lines()
        if not 0 <= y < len(lines):
            return None
        tokens = [s for s in lines[y] if s.position is not None]
        if not tokens:
            return None
        for s in tokens:
            if s.column <= x < s.column + cell_len(s.text):
                return s.position
        return min(tokens, key=lambda s: abs(s.column - x)).position

    def vertical(self, step: int) -> int:
        """The token one line up (-1) or down (+1) from the cursor, near its column."""
        lines = self.lines()
        y = self.line_of(self.cursor)
        column = next((s.column for s in lines[y] if s.position == self.cursor), 0) if lines else 0
        target = y + step
        while 0 <= target < len(lines):
            found = self.at(column, target)
            if found is not None:
                return found
            target += step
        return self.cursor

    def render(self) -> Text:
        if self.pieces is None:
            return Text("")
        shading = self.SHADING
        text = Text(no_wrap=True, overflow="crop")
        cursor = self.style_for(f"{shading.name}--cursor")
        for y, line in enumerate(self.lines()):
            if y:
                text.append("\n")
            for s in line:
                if s.position is None:
                    text.append(s.text, self.style_for("dim"))
                    continue
                name = self.levels[s.position]
                style = self.style_for(f"{shading.name}--{name}")
                drawn = shading.glyphs[name] if self.pieces[s.position] is None else s.text
                text.append(drawn, style + cursor + self.CURSOR_OVER if s.position == self.cursor else style)
        return text

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and (found := self.at(offset.x, offset.y)) is not None:
            self.screen.move_to(found)


# -- the screen -----------------------------------------------------------------------------------
class TokenScreen(ModalScreen):
    """A view of one text: a head (a summary line and the legend, then any note), the text, the view's
    own parts under it (`compose_parts`, which sets `detail`: the pane on the cursor's token), hints.
    A subclass says how many tokens there are (`count`), what `detail` says of one (`describe`), the
    head's words (`head_line`, `head_note`), and its BINDINGS: its keys to close it, then CURSOR_BINDINGS."""

    STYLED: type[Styled]  # the view's widgets' base (its shading and looks)
    TEXT: type[TokenText]
    TEXT_TITLE = "{title}"  # the text pane's title
    HINTS = ""
    DEFAULT_CSS = """
    TokenScreen { align: center middle; }
    TokenScreen .token-box { width: 100%; height: 100%; }
    TokenScreen .token-head { height: auto; padding: 0 1; }
    TokenScreen .token-text-pane { height: 1fr; min-height: 3; }
    TokenScreen .token-hints { height: 1; padding: 0 1; }
    """

    def __init__(self, title: str):
        super().__init__()
        self.title_text = title
        self.note: str | None = None  # why what is drawn is not current, or nothing is drawn
        self.cursor: int | None = None
        self.detail: Static | None = None

    def compose(self) -> ComposeResult:
        name = self.STYLED.SHADING.name
        self.head = self.STYLED(id=f"{name}-head", classes="token-head")
        self.text = self.TEXT(id=f"{name}-text")
        with Vertical(id=f"{name}-box", classes="token-box"):
            yield self.head
            # Titled rules rather than boxes between the parts: at 80×24 every row counts.
            with self.part("text", self.TEXT_TITLE.format(title=self.title_text), "token-text-pane") as self.text_pane:
                yield self.text
            yield from self.compose_parts()
            yield Static(self.HINTS, id=f"{name}-hints", classes="token-hints")

    def part(self, name: str, title: str, classes: str = "") -> VerticalScroll:
        """A pane under a titled rule, id `<view>-<name>-pane` (use it in a `with`)."""
        pane = VerticalScroll(id=f"{self.STYLED.SHADING.name}-{name}-pane", classes=f"kept-part {classes}".strip(),
                              can_focus=False)
        pane.border_title = title
        return pane

    def compose_parts(self) -> ComposeResult:
        raise NotImplementedError

    def count(self) -> int:
        raise NotImplementedError

    def describe(self, position: int) -> Text:
        raise NotImplementedError

    def head_line(self) -> str | None:
        """The head's first line, None while there is nothing to draw."""
        raise NotImplementedError

    def head_note(self) -> str | None:
        return self.note

    # -- drawing ----------------------------------------------------------------------------
    def show_head(self) -> None:
        line, note = self.head_line(), self.head_note()
        text = Text()
        if line is not None:
            text.append(f"{line}\n", "bold")
            text.append_text(self.head.legend())
        if note:
            text.append(("\n" if line is not None else "") + note, self.head.style_for("dim"))
        self.head.update(text)

    def show_cursor(self) -> None:
        if self.cursor is None or not self.count():
            self.detail.update("")
            return
        self.mark(self.cursor)
        self.detail.update(self.describe(self.cursor))
        self.scroll_to_cursor()

    def mark(self, position: int) -> None:
        """Point the drawn parts at the cursor's token."""
        self.text.cursor = position
        self.text.refresh()

    def scroll_to_cursor(self) -> None:
        pane = self.text_pane
        line = self.text.line_of(self.cursor)
        height = max(1, pane.scrollable_content_region.height)
        if line < pane.scroll_y:
            pane.scroll_to(y=line, animate=False)
        elif line >= pane.scroll_y + height:
            pane.scroll_to(y=line - height + 1, animate=False)

    # -- keys and clicks --------------------------------------------------------------------
    def move_to(self, position: int) -> None:
        if not self.count():
            return
        self.cursor = max(0, min(position, self.count() - 1))
        self.show_cursor()

    def action_move(self, step: int) -> None:
        if self.cursor is not None:
            self.move_to(self.cursor + step)

    def action_line(self, step: int) -> None:
        if self.cursor is not None:
            self.move_to(self.text.vertical(step))

    def action_jump(self, where: int) -> None:
        self.move_to(where if where >= 0 else self.count() - 1)
