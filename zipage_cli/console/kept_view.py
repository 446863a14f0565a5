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
from typing import Callable

from rich.style import Style
from rich.text import Text
from textual import events, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from zipage.engine.events import Event
from zipage.cli.console.kept_source import Holding
from zipage.cli.console.kept_words import (GLYPHS, LEVEL_LABELS, LEVELS, first_dropped, held_summary, level,
                                           reasons_lines, strip_rows)
from zipage.cli.console.token_view import CURSOR_BINDINGS, Shading, Styled, TokenScreen, TokenText
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


class KeptStyled(Styled):
    """Base of the kept view's widgets: the shading of each level lives in the theme (themes/console.tcss)."""

    SHADING = Shading("kept", LEVELS, GLYPHS, LEVEL_LABELS)


class KeptText(KeptStyled, TokenText):
    """The request's text, each token shaded by how widely it is still held; the cursor token marked."""

    def show(self, holding: Holding) -> None:
        self.show_text(holding.pieces, [level(share) for share in holding.map.share()], holding.prompt_tokens)


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
class KeptScreen(TokenScreen):
    """What one request still holds. `fetch()` runs in a worker thread and returns a Holding, or a
    sentence saying why there is none (the request ended, the engine cannot say)."""

    BINDINGS = [Binding("escape,f3,alt+k,q", "close", "Close", tooltip="Close the kept view"), *CURSOR_BINDINGS]
    DEFAULT_CSS = """
    KeptScreen #kept-strip-pane { height: auto; max-height: 35%; }
    KeptScreen #kept-reasons-pane { height: auto; max-height: 30%; }
    KeptScreen .kept-part { padding: 0 1; }
    """
    STYLED, TEXT = KeptStyled, KeptText
    TEXT_TITLE = "What {title} still holds"
    HINTS = "←/→ token · ↑/↓ line · Home/End · click a token or the strip · Esc closes"

    def __init__(self, request: int, title: str, fetch: Callable[[], Holding | str], refresh_s: float = REFRESH_S,
                 last: Holding | None = None):
        """`last`: the map an earlier view of the request showed, drawn until a fresh one comes (and kept
        if none can: a finished request's KV is freed). The screen is dismissed with its latest map."""
        super().__init__(title)
        self.request, self.fetch, self.refresh_s = request, fetch, refresh_s
        self.last = last if last is not None and last.request == request else None
        self.holding: Holding | None = None
        self.note = "asking the engine…"  # why the map shown is not current, or none is shown
        self.fetching = False
        self.last_fetch = 0.0

    def compose_parts(self) -> ComposeResult:
        self.strip = KeptStrip(id="kept-strip")
        self.reasons = self.detail = Static(id="kept-reasons")
        with self.part("strip", "Layers × positions: share of each layer's KV heads"):
            yield self.strip
        with self.part("reasons", "The token under the cursor"):
            yield self.reasons

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
    def count(self) -> int:
        return self.holding.map.num_positions if self.holding is not None else 0

    def head_line(self) -> str | None:
        if self.holding is None:
            return None
        m = self.holding.map
        return (f"#{self.request}: {m.num_positions} positions, {m.compressions} "
                f"compression{'s' if m.compressions != 1 else ''}, {m.num_layers} layers × "
                f"{m.num_kv_heads} KV heads · {time.strftime('%H:%M:%S', time.localtime(self.holding.taken))}")

    def head_note(self) -> str | None:
        return "; ".join(n for n in (self.note, self.holding.note if self.holding else None) if n)

    def mark(self, position: int) -> None:
        super().mark(position)
        self.strip.cursor = position
        self.strip.refresh()

    def describe(self, p: int) -> Text:
        h = self.holding
        piece = h.pieces[p]
        where = ("" if h.prompt_tokens is None else " · prompt" if p < h.prompt_tokens
                 else f" · answer token {p - h.prompt_tokens + 1}")
        said = f" {printable(piece)!r}" if piece else ""
        words = Text(f"position {p}{said}{where} · {held_summary(h.map, p)}\n", "bold")
        words.append("\n".join(reasons_lines(h.map, p)))
        return words

    def action_close(self) -> None:
        self.dismiss(self.holding)
