"""The kept view: what one request's KV cache still holds, token by token (docs/design-notes.md,
"What a request still holds": each layer and KV head keeps its own entries, each for a reason).

Its text is shaded by the share of (layer, KV head) pairs still holding each token; a strip below
draws one row per layer, positions bucketed to the width, each cell the share of that layer's heads
holding the bucket; a cursor (arrow keys or a click) picks a token and shows why each layer keeps or
evicted it. The map is fetched in a worker thread when the view opens, then at most once a second,
and at once when the app reports a compression of the request: never per frame.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual import events, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from zipage.engine.events import Event
from zipage.cli.console.kept_source import Holding
from zipage.cli.console.kept_words import (GLYPHS, LEVEL_LABELS, LEVELS, first_dropped, held_summary, level,
                                           reasons_lines, strip_rows)
from zipage.cli.console.widgets import printable

REFRESH_S = 1.0  # the map is asked for at most this often (and at once after a compression)
KEPT_HELP = "What the selected request's KV still holds, token by token and layer by layer"
# The help screens' words on the view.
KEPT_TERMS = """\
The kept view: the request's text, each token shaded by the share of (layer, KV head) pairs still
holding it (█ kept everywhere, ▓ by half or more, ░ by under half, · gone everywhere), then one row
per layer over the positions. Arrow keys or a click pick a token; each layer then says why its
heads hold it: sink (one of the first tokens), recent (the newest), prompt (a prompt kept whole),
score (chosen by attention, with the score), or that they evicted it."""
MAX_REPEAT = 4  # columns per position in the strip, for a request shorter than the width
UNKNOWN = "▫"  # a token without text of its own: it starts a character that a later token ends
ANSWER_LABEL = "── answer ──"


class KeptStyled(Static):
    """Base of the view's widgets: the shading of each level lives in the theme (themes/console.tcss)."""

    COMPONENT_CLASSES = {f"kept--{name}" for name in LEVELS} | {"kept--cursor", "dim"}

    def style_for(self, name: str):
        return self.get_component_rich_style(name, partial=True)


# -- the text -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    position: int | None  # None: a label (the answer's start)
    column: int
    text: str


def shown(piece: str | None) -> tuple[str, bool]:
    """A token as drawn, and whether a line break follows it: newlines become ↵ (then a break), tabs ⇥.
    A token without text of its own (it starts a character) is ▫; one whose text is unknown here is one
    cell, drawn with its level's strip glyph."""
    if piece is None:
        return GLYPHS["all"], False
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


class KeptText(KeptStyled):
    """The request's text, each token shaded by how widely it is still held; the cursor token marked."""

    DEFAULT_CSS = "KeptText { height: auto; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.holding: Holding | None = None
        self.shares: list[float] = []
        self.cursor = 0
        self._lines: tuple[int, list[list[Segment]]] | None = None  # (width, lines)

    def show(self, holding: Holding) -> None:
        self.holding, self.shares, self._lines = holding, holding.map.share(), None
        self.refresh(layout=True)

    def lines(self, width: int | None = None) -> list[list[Segment]]:
        width = self.content_size.width if width is None else width
        if self._lines is None or self._lines[0] != width:
            h = self.holding
            self._lines = (width, layout(h.pieces, width, h.prompt_tokens) if h else [])
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
        if self.holding is None:
            return Text("")
        text = Text(no_wrap=True, overflow="crop")
        cursor = self.style_for("kept--cursor")
        for y, line in enumerate(self.lines()):
            if y:
                text.append("\n")
            for s in line:
                if s.position is None:
                    text.append(s.text, self.style_for("dim"))
                    continue
                name = level(self.shares[s.position])
                style = self.style_for(f"kept--{name}")
                drawn = GLYPHS[name] if self.holding.pieces[s.position] is None else s.text
                text.append(drawn, style + cursor if s.position == self.cursor else style)
        return text

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and (found := self.at(offset.x, offset.y)) is not None:
            self.screen.move_to(found)


# -- the strip ------------------------------------------------------------------------------------
class KeptStrip(KeptStyled):
    """One row per layer; each cell a bucket of positions, its glyph and colour the share of the
    layer's heads holding it. The last row marks the answer's start (╵) and the cursor (▲)."""

    DEFAULT_CSS = "KeptStrip { height: auto; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.holding: Holding | None = None
        self.cursor = 0
        self._rows: tuple[int, list, list] | None = None  # (cells, buckets, rows)
        self.repeat = 1  # columns per bucket: a short request is drawn wider, to read and click

    def show(self, holding: Holding) -> None:
        self.holding, self._rows = holding, None
        self.refresh(layout=True)

    def label_width(self) -> int:
        return len(f"L{max(0, self.holding.map.num_layers - 1)} ") if self.holding else 0

    def rows(self) -> tuple[list[range], list[list[float]]]:
        cells = max(1, self.content_size.width - self.label_width())
        if self._rows is None or self._rows[0] != cells:
            self._rows = (cells, *strip_rows(self.holding.map, cells))
            self.repeat = max(1, min(MAX_REPEAT, cells // max(1, len(self._rows[1]))))
        return self._rows[1], self._rows[2]

    def get_content_height(self, container, viewport, width: int) -> int:
        return self.holding.map.num_layers + 1 if self.holding and self.holding.map.num_positions else 1

    def render(self) -> Text:
        h = self.holding
        if h is None or not h.map.num_positions:
            return Text("nothing written yet", self.style_for("dim"))
        spans, rows = self.rows()
        pad = self.label_width()
        text = Text(no_wrap=True, overflow="crop")
        for layer, row in enumerate(rows):
            text.append(f"L{layer}".ljust(pad), self.style_for("dim"))
            for share in row:
                name = level(share)
                text.append(GLYPHS[name] * self.repeat, self.style_for(f"kept--{name}"))
            text.append("\n")
        text.append(" " * pad)
        for span in spans:
            if self.cursor in span:
                text.append("▲", self.style_for("kept--all") + Style(bold=True))
            elif h.prompt_tokens and h.prompt_tokens in span:
                text.append("╵", self.style_for("dim"))  # the answer starts here
            else:
                text.append(" ")
            text.append(" " * (self.repeat - 1))
        return text

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or self.holding is None or not self.holding.map.num_positions:
            return
        spans, _ = self.rows()
        b = (offset.x - self.label_width()) // self.repeat
        if 0 <= b < len(spans) and offset.x >= self.label_width():
            self.screen.move_to(spans[b].start)


# -- the screen -----------------------------------------------------------------------------------
def legend(widget: KeptStyled) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    for name in reversed(LEVELS):
        style = widget.style_for(f"kept--{name}")
        text.append(GLYPHS[name], style)
        text.append(" ")
        text.append(LEVEL_LABELS[name], style)
        text.append("  ")
    return text


class KeptScreen(ModalScreen):
    """What one request still holds. `fetch()` runs in a worker thread and returns a Holding, or a
    sentence saying why there is none (the request ended, the engine cannot say)."""

    BINDINGS = [
        Binding("escape,f3,alt+k,q", "close", "Close", tooltip="Close the kept view"),
        Binding("left", "move(-1)", "Previous token", show=False),
        Binding("right", "move(1)", "Next token", show=False),
        Binding("up", "line(-1)", "Line up", show=False),
        Binding("down", "line(1)", "Line down", show=False),
        Binding("home", "jump(0)", "First token", show=False),
        Binding("end", "jump(-1)", "Last token", show=False),
    ]
    DEFAULT_CSS = """
    KeptScreen { align: center middle; }
    KeptScreen #kept-box { width: 100%; height: 100%; }
    KeptScreen #kept-head { height: auto; padding: 0 1; }
    KeptScreen #kept-text-pane { height: 1fr; min-height: 3; }
    KeptScreen #kept-strip-pane { height: auto; max-height: 35%; }
    KeptScreen #kept-reasons-pane { height: auto; max-height: 30%; }
    KeptScreen .kept-part { padding: 0 1; }
    KeptScreen #kept-hints { height: 1; padding: 0 1; }
    """

    def __init__(self, request: int, title: str, fetch: Callable[[], Holding | str], refresh_s: float = REFRESH_S,
                 last: Holding | None = None):
        """`last`: the map an earlier view of the request showed, drawn until a fresh one comes (and kept
        if none can: a finished request's KV is freed). The screen is dismissed with its latest map."""
        super().__init__()
        self.request, self.title_text, self.fetch, self.refresh_s = request, title, fetch, refresh_s
        self.last = last if last is not None and last.request == request else None
        self.holding: Holding | None = None
        self.note: str | None = "asking the engine…"  # why the map shown is not current, or none is shown
        self.fetching = False
        self.last_fetch = 0.0
        self.cursor: int | None = None

    def compose(self) -> ComposeResult:
        self.head = KeptStyled(id="kept-head")
        self.text = KeptText(id="kept-text")
        self.strip = KeptStrip(id="kept-strip")
        self.reasons = Static(id="kept-reasons")
        with Vertical(id="kept-box"):
            yield self.head
            # Titled rules rather than boxes between the parts: at 80×24 every row counts.
            with VerticalScroll(id="kept-text-pane", classes="kept-part", can_focus=False) as pane:
                pane.border_title = f"What {self.title_text} still holds"
                yield self.text
            with VerticalScroll(id="kept-strip-pane", classes="kept-part", can_focus=False) as pane:
                pane.border_title = "Layers × positions: share of each layer's KV heads"
                yield self.strip
            with VerticalScroll(id="kept-reasons-pane", classes="kept-part", can_focus=False) as pane:
                pane.border_title = "The token under the cursor"
                yield self.reasons
            yield Static("←/→ token · ↑/↓ line · Home/End · click a token or the strip · Esc closes",
                         id="kept-hints", classes="dim")

    def on_mount(self) -> None:
        if self.last is not None:
            self.take_result(self.last)
        self.show_head()
        self.ask(now=True)
        self.set_interval(self.refresh_s, self.ask)

    # -- fetching ---------------------------------------------------------------------------
    def ask(self, now: bool = False) -> None:
        """Fetch the map, unless a fetch is under way or (unless `now`) the last one is under a second old."""
        if self.fetching or (not now and time.monotonic() - self.last_fetch < self.refresh_s):
            return
        if self.holding is not None and self.note is not None:
            return  # the request has ended: its last map stays as it is
        self.fetching = True
        self.last_fetch = time.monotonic()
        self.run_fetch()

    @work(thread=True, exclusive=True, group="kept")
    def run_fetch(self) -> None:
        try:
            result = self.fetch()
        finally:
            self.fetching = False
        self.app.call_from_thread(self.take_result, result)

    def engine_events(self, happened: list[Event]) -> None:
        """The app's events since its last look: a compression of this request is worth a fetch at once."""
        if any(e.kind == "compressed" and e.request == self.request for e in happened):
            self.ask(now=True)

    def take_result(self, result: Holding | str) -> None:
        if isinstance(result, str):
            self.note = result if self.holding is None else f"{result}; showing its last map"
        else:
            self.holding, self.note = result, None
            if self.cursor is None:
                self.cursor = first_dropped(result.map)
            self.cursor = min(self.cursor, max(0, result.map.num_positions - 1))
            self.text.show(result)
            self.strip.show(result)
        self.show_head()
        self.show_cursor()

    # -- drawing ----------------------------------------------------------------------------
    def show_head(self) -> None:
        h = self.holding
        text = Text()
        if h is not None:
            m = h.map
            text.append(f"#{self.request}: {m.num_positions} positions, {m.compressions} "
                        f"compression{'s' if m.compressions != 1 else ''}, {m.num_layers} layers × "
                        f"{m.num_kv_heads} KV heads · {time.strftime('%H:%M:%S', time.localtime(h.taken))}\n",
                        "bold")
            text.append_text(legend(self.head))
        note = "; ".join(n for n in (self.note, h.note if h else None) if n)
        if note:
            text.append(("\n" if h is not None else "") + note, self.head.style_for("dim"))
        self.head.update(text)

    def show_cursor(self) -> None:
        h = self.holding
        if h is None or self.cursor is None or not h.map.num_positions:
            self.reasons.update("")
            return
        self.text.cursor = self.strip.cursor = self.cursor
        self.text.refresh()
        self.strip.refresh()
        p = self.cursor
        piece = h.pieces[p]
        where = ("" if h.prompt_tokens is None else " · prompt" if p < h.prompt_tokens
                 else f" · answer token {p - h.prompt_tokens + 1}")
        said = f" {printable(piece)!r}" if piece else ""
        words = Text(f"position {p}{said}{where} · {held_summary(h.map, p)}\n", "bold")
        words.append("\n".join(reasons_lines(h.map, p)))
        self.reasons.update(words)
        self.scroll_to_cursor()

    def scroll_to_cursor(self) -> None:
        pane = self.query_one("#kept-text-pane", VerticalScroll)
        line = self.text.line_of(self.cursor)
        height = max(1, pane.scrollable_content_region.height)
        if line < pane.scroll_y:
            pane.scroll_to(y=line, animate=False)
        elif line >= pane.scroll_y + height:
            pane.scroll_to(y=line - height + 1, animate=False)

    # -- keys and clicks --------------------------------------------------------------------
    def move_to(self, position: int) -> None:
        if self.holding is None or not self.holding.map.num_positions:
            return
        self.cursor = max(0, min(position, self.holding.map.num_positions - 1))
        self.show_cursor()

    def action_move(self, step: int) -> None:
        if self.cursor is not None:
            self.move_to(self.cursor + step)

    def action_line(self, step: int) -> None:
        if self.cursor is not None:
            self.move_to(self.text.vertical(step))

    def action_jump(self, where: int) -> None:
        if self.holding is not None:
            self.move_to(where if where >= 0 else self.holding.map.num_positions - 1)

    def action_close(self) -> None:
        self.dismiss(self.holding)
