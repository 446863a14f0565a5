"""Widgets shared by `zipage chat` and `zipage top`: block tables, the pool map, the event log,
throughput sparklines, gauges and the help screen.

Every widget draws from `engine.events` records only (snapshots and events). Colours come from
component classes, so the theme (zipage.themes) restyles them and a theme switch repaints them.
"""

from __future__ import annotations

import queue
import time
from collections import deque

from rich.console import Group
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Sparkline, Static

from zipage.engine.events import (EVENT_KINDS, Aborted, Admitted, Compressed, Failed, Finished, Preempted,
                                  Prefilled, EngineSnapshot, Event, Latency, RequestInfo)
from zipage.engine.latency import STALL_S
from zipage.cli.console.fit import wrap_items

ROLES = ("shared", "reused", "private", "target", "decode")
# One glyph per role so the roles read apart even without colour (high-contrast, monochrome).
GLYPHS = {"shared": "◆", "reused": "◇", "private": "■", "target": "▣", "decode": "▶", "cached": "▪", "free": "·"}
ROLE_LABELS = {"shared": "shared prefix", "reused": "prefix from the cache", "private": "private", "target": "compressed target",
               "decode": "decode", "cached": "free, cached prefix", "free": "free"}
OWNER_COLOURS = 12  # owner--0 .. owner--11 in each theme
# With more live requests than colours, the colours come round again under these text styles,
# so that up to 36 live requests all look different.
OWNER_STYLES = ("", "underline", "reverse")

# What the panes' terms mean; both apps' help screens show it.
PANE_TERMS = """\
Terms in the panes:
  kv                 KV entries a request holds in the cache (drops when compression evicts)
  blocks             fixed-size pages of the KV pool; a request holds a table of them
  shared prefix      a block other requests use too (a common prompt start), never written
  compressed target  a block holding the entries kept by a compression
  decode             the fresh block a compressed request writes its next tokens into
  budget/held        a request's KV budget in blocks (a floor under elastic budgets) / the blocks it
                     holds; then why it was last compressed: at its budget, or the pool was short
  q-slots            query slots: the last window's queries kept per request, needed to score
                     its cache; a request must hold one to be compressed
  TTFT / ITL         time to first token / between two tokens of one answer
  queue              time from arrival until a request gets its blocks"""

# C0 control characters (but newline and tab) as their visible "control pictures": a random-weight
# model emits arbitrary bytes, and a raw escape must never reach the terminal.
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {127: 0x2421}


def printable(text: str) -> str:
    return text.translate(_CONTROL_PICTURES)


def drain(q: queue.Queue) -> list:
    """Everything waiting in a subscription queue, without blocking."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def fmt_rate(tok_s: float) -> str:
    return f"{tok_s / 1000:.1f}k" if tok_s >= 10_000 else f"{tok_s:.0f}"


def describe_event(event: Event) -> str:
    """One plain line for an engine event (the log and the teaching notes both use it)."""
    match event:
        case Admitted(prompt_tokens=prompt, blocks=blocks, cached_tokens=cached):
            return f"admitted: {prompt}-token prompt, {blocks} blocks" + (f", {cached} tokens cached" if cached else "")
        case Prefilled(tokens=tokens, seconds=seconds):
            return f"prefilled {tokens} tokens ({1000 * seconds:.0f} ms)"
        case Compressed() as c:
            prompt = min(c.prompt_kept, c.tokens_after)
            recent = min(c.recent_kept, c.tokens_after - prompt)
            return (f"compressed {c.blocks_before}→{c.blocks_after} blocks, {compression_cause(c)}: "
                    f"{c.tokens_before}→{c.tokens_after} entries per layer ("
                    + (f"{prompt} prompt + " if prompt else "") + f"{recent} newest + "
                    f"{c.tokens_after - prompt - recent} by score), {1000 * c.seconds:.1f} ms")
        case Preempted(output_tokens=tokens):
            return f"preempted after {tokens} tokens: blocks freed, requeued"
        case Failed(error=error):
            return f"error: {error or '?'}"
        case Finished() | Aborted():
            return f"{event.kind} ({event.reason}, {event.output_tokens} tokens)"
    return event.kind


def compression_cause(c: Compressed) -> str:
    """Why a compression ran, in a few words (docs/design-notes.md, "Budgets")."""
    if c.reason == "pool":
        return "pool short" + (f", down to its floor of {c.budget_blocks}" if c.budget_blocks else "")
    return "at its budget" + (f" of {c.budget_blocks}" if c.budget_blocks else "")


def budget_cell(r: RequestInfo) -> str:
    """A request's budget (its floor under elastic budgets) / the blocks it holds, and why it was last
    compressed ("budget" or "pool"): "8/31 pool". A full-KV engine has no budget: "-/31"."""
    budget = "-" if r.kv_budget is None else str(r.kv_budget)
    return f"{budget}/{len(r.block_table)}" + (f" {r.compressed_for}" if r.compressed_for else "")


class RoleStyled(Static):
    """Base for widgets drawing blocks: the role and owner colours live in the theme."""

    COMPONENT_CLASSES = ({f"role--{r}" for r in (*ROLES, "cached", "free")}
                         | {f"owner--{i}" for i in range(OWNER_COLOURS)} | {"dim", "selected"})

    def style_for(self, name: str):
        return self.get_component_rich_style(name, partial=True)

    def legend(self, roles=(*ROLES,), width: int | None = None) -> Text:
        """Glyph and meaning of each role, wrapped between entries rather than inside one."""
        width = self.content_size.width if width is None else width
        text, column = Text(), 0
        for role in roles:
            entry = f"{GLYPHS[role]} {ROLE_LABELS[role]}   "
            if column and column + len(entry.rstrip()) > width:
                text.append("\n")
                column = 0
            text.append(GLYPHS[role], self.style_for(f"role--{role}"))
            text.append(entry[1:], self.style_for("dim"))
            column += len(entry)
        return text


class BlockTable(RoleStyled):
    """Each live request's block table, one glyph per block, coloured by role."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.requests: tuple[RequestInfo, ...] = ()

    def show(self, snapshot: EngineSnapshot) -> None:
        self.requests = snapshot.requests
        self.refresh(layout=True)  # the number of lines changes with the requests

    def render(self) -> Text:
        text = Text()
        if not self.requests:
            text.append("no request holds blocks right now\n", self.style_for("dim"))
        dim = self.style_for("dim")
        for r in sorted(self.requests, key=lambda r: r.id):
            items = [Text(f"#{r.id} {r.session or '-'} ", "bold") + Text(r.status, dim), Text(f"kv {r.kv_len}", dim)]
            if r.kv_budget is not None:
                items.append(Text(f"budget {r.kv_budget}", dim))
            if r.times_compressed:
                why = " (pool short)" if r.compressed_for == "pool" else ""
                items.append(Text(f"compressed {r.times_compressed}×{why}", dim))
            text.append_text(wrap_items(items, self.content_size.width, style=dim))
            text.append("\n")
            for role in r.block_roles:
                text.append(GLYPHS[role] + " ", self.style_for(f"role--{role}"))
            text.append("\n")
        text.append("\n")
        text.append_text(self.legend())
        return text


class PoolMap(RoleStyled):
    """Every block of the pool: glyph by role, colour by owning request; free blocks dim, and
    free blocks that still hold a reusable prefix marked as cached."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.snapshot: EngineSnapshot | None = None
        self.selected: int | None = None
        self.cached: set[int] = set()
        self.owned: dict[int, tuple[int, str]] = {}  # block -> (request id, role)
        self.looks: dict[int, int] = {}  # live request id -> its look (colour + style), unique while live

    def show(self, snapshot: EngineSnapshot, selected: int | None = None) -> None:
        owned = {}
        for r in snapshot.requests:
            for block, role in zip(r.block_table, r.block_roles):
                owned.setdefault(block, (r.id, role))
        self.owned, self.cached = owned, set(snapshot.pool.cached_blocks)
        self.assign_looks([r.id for r in snapshot.requests])
        resized = self.snapshot is None
        self.snapshot, self.selected = snapshot, selected
        self.refresh(layout=resized)

    def assign_looks(self, live: list[int]) -> None:
        """Keep each live request's look; a newcomer takes the first look no live request has."""
        self.looks = {rid: look for rid, look in self.looks.items() if rid in live}
        taken = set(self.looks.values())
        free = (look for look in range(OWNER_COLOURS * len(OWNER_STYLES) + len(live)) if look not in taken)
        for rid in sorted(live):
            if rid not in self.looks:
                self.looks[rid] = next(free)

    def owner_style(self, request: int):
        look = self.looks.get(request, request)
        style = self.style_for(f"owner--{look % OWNER_COLOURS}")
        modifier = OWNER_STYLES[(look // OWNER_COLOURS) % len(OWNER_STYLES)]
        return style + Style.parse(modifier) if modifier else style

    MAX_ROWS = 16  # past this, several blocks share a glyph
    LEGEND = (*ROLES, "cached", "free")

    def max_rows(self) -> int:
        """Rows of glyphs: fewer in a short terminal, so the legend under them still shows."""
        return max(2, min(self.MAX_ROWS, self.app.size.height // 8))

    def layout(self, width: int) -> tuple[int, int, int]:
        """(columns per glyph, blocks per glyph, glyphs per row): two columns per block while the pool
        fits that way (easier to read), else one; a pool too large even then shares glyphs."""
        total = self.snapshot.pool.total if self.snapshot else 0
        width, rows = max(8, width), self.max_rows()
        spacing = 2 if total * 2 <= width * rows else 1
        per_row = width // spacing
        return spacing, max(1, -(-total // (per_row * rows))), per_row

    def get_content_height(self, container, viewport, width: int) -> int:
        if self.snapshot is None:
            return 1
        _, per_cell, per_row = self.layout(width)
        legend = len(self.legend(self.LEGEND, width).split())  # its lines, as wrapped at this width
        return -(-self.snapshot.pool.total // (per_cell * per_row)) + 1 + legend  # rows, a blank line, the legend

    def render(self) -> Text:
        if self.snapshot is None:
            return Text("waiting for the first snapshot…")
        total = self.snapshot.pool.total
        spacing, per_cell, per_row = self.layout(self.content_size.width)
        text = Text()
        for cell, start in enumerate(range(0, total, per_cell)):
            glyph, style = self._cell(range(start, min(start + per_cell, total)))
            text.append(glyph + " " * (spacing - 1), style)
            if (cell + 1) % per_row == 0:
                text.append("\n")
        if -(-total // per_cell) % per_row:
            text.append("\n")  # the last row's end (a full row has ended itself)
        text.append("\n")
        text.append_text(self.legend(self.LEGEND))
        if per_cell > 1:
            text.append(f" (one glyph = {per_cell} blocks)", self.style_for("dim"))
        return text

    def _cell(self, blocks: range) -> tuple[str, object]:
        """Draw the most telling block of a cell: owned beats cached beats free."""
        for block in blocks:
            if block in self.owned:
                request, role = self.owned[block]
                style = self.owner_style(request)
                if request == self.selected:
                    style += self.style_for("selected")
                return GLYPHS[role], style
        if any(b in self.cached for b in blocks):
            return GLYPHS["cached"], self.style_for("role--cached")
        return GLYPHS["free"], self.style_for("role--free")


class EventLog(Static):
    """The newest engine events, newest last; restyled on theme change (colours per kind). Every line
    is shown whole, wrapped under its time stamp; the selected request's lines are marked."""

    COMPONENT_CLASSES = {f"event--{k}" for k in EVENT_KINDS} | {"dim", "selected"}
    DEFAULT_CSS = "EventLog { height: 1fr; }"
    STAMP = 9  # "HH:MM:SS "

    def __init__(self, max_events: int = 500, **kwargs):
        super().__init__(**kwargs)
        self.events: deque[Event] = deque(maxlen=max_events)
        self.selected: int | None = None

    def add(self, events: list[Event]) -> None:
        if events:
            self.events.extend(events)
            self.refresh()

    def select(self, request: int | None) -> None:
        if request != self.selected:
            self.selected = request
            self.refresh()

    def line(self, event: Event) -> str:
        return (f"#{event.request} " if event.request is not None else "") + describe_event(event)

    def render(self) -> Text:
        dim = self.get_component_rich_style("dim", partial=True)
        if not self.events:
            return Text("no events yet", dim)
        width = max(10, self.content_size.width - self.STAMP)
        rows_left, shown = max(1, self.content_size.height), []
        for event in reversed(self.events):  # the newest that fit, each with all its wrapped rows
            rows = -(-len(self.line(event)) // width)
            if shown and rows > rows_left:
                break
            shown.append(event)
            rows_left -= rows
        text = Text()
        for i, event in enumerate(reversed(shown)):
            words = Text(self.line(event), self.get_component_rich_style(f"event--{event.kind}", partial=True))
            if event.request is not None and event.request == self.selected:
                words.stylize(self.get_component_rich_style("selected", partial=True))
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            for j, row in enumerate(words.wrap(self.app.console, width)):
                text.append(f"{stamp} " if j == 0 else " " * self.STAMP, dim)
                text.append_text(row)
                text.append("\n")
        text.rstrip()
        return text


class Throughput(Vertical):
    """Prefill and decode tokens/s: the current value and a sparkline of the last half minute."""

    HISTORY = 120  # samples, at the console's refresh rate

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prefill: deque[float] = deque([0.0] * self.HISTORY, maxlen=self.HISTORY)
        self.decode: deque[float] = deque([0.0] * self.HISTORY, maxlen=self.HISTORY)
        self.prefill_label, self.decode_label = Label(), Label()
        self.prefill_spark = Sparkline(list(self.prefill), id="prefill-spark")
        self.decode_spark = Sparkline(list(self.decode), id="decode-spark")

    def compose(self) -> ComposeResult:
        yield from (self.prefill_label, self.prefill_spark, self.decode_label, self.decode_spark)

    def show(self, snapshot: EngineSnapshot) -> None:
        self.prefill.append(snapshot.throughput.prefill)
        self.decode.append(snapshot.throughput.decode)
        self.prefill_label.update(f"prefill {fmt_rate(snapshot.throughput.prefill)} tok/s")
        self.decode_label.update(f"decode  {fmt_rate(snapshot.throughput.decode)} tok/s")
        self.prefill_spark.data = list(self.prefill)
        self.decode_spark.data = list(self.decode)


class Gauge(Static):
    """A labelled horizontal bar: `label ████░░░░ detail`."""

    COMPONENT_CLASSES = {"gauge--fill", "gauge--empty", "gauge--label"}

    def __init__(self, label: str, **kwargs):
        super().__init__(**kwargs)
        self.label = label
        self.fraction = 0.0
        self.detail = ""

    def set(self, used: float, total: float, detail: str) -> None:
        self.fraction = min(1.0, used / total) if total else 0.0
        self.detail = detail
        self.refresh()

    def render(self) -> Text:
        label = f"{self.label:<8}"
        width = max(4, self.content_size.width - len(label) - len(self.detail) - 2)
        filled = round(self.fraction * width)
        text = Text(label, self.get_component_rich_style("gauge--label", partial=True), no_wrap=True)
        text.append("█" * filled, self.get_component_rich_style("gauge--fill", partial=True))
        text.append("░" * (width - filled), self.get_component_rich_style("gauge--empty", partial=True))
        text.append(f" {self.detail}")
        return text


class Gauges(Vertical):
    """KV pool blocks, query slots, KV bytes in use, and the process's (or GPU's) memory."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks, self.slots = Gauge("blocks"), Gauge("q-slots")
        self.kv, self.memory = Gauge("KV"), Gauge("memory")

    def compose(self) -> ComposeResult:
        yield from (self.blocks, self.slots, self.kv, self.memory)

    def show(self, snapshot: EngineSnapshot) -> None:
        pool, mem = snapshot.pool, snapshot.memory
        self.blocks.set(pool.used, pool.total, f"{pool.used}/{pool.total}")
        self.slots.set(pool.query_slots_used, pool.query_slots_total,
                       f"{pool.query_slots_used}/{pool.query_slots_total}")
        kv_used = mem.kv * pool.used / pool.total if pool.total else 0
        self.kv.label = f"KV {mem.kv_dtype}".strip()  # 8-bit codes hold twice the tokens of bf16 per byte
        self.kv.set(kv_used, mem.kv, f"{fmt_bytes(kv_used)}/{fmt_bytes(mem.kv)}")
        self.memory.set(mem.device_used, mem.device_total,
                        f"{fmt_bytes(mem.device_used)}/{fmt_bytes(mem.device_total)}")


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


class LatencyView(Static):
    """TTFT, inter-token latency and queue time (p50/p95/p99) over one of the snapshot's sliding
    windows, the prefix-cache hit rate, event rates, and a stall warning. A click (or top's w key)
    switches the window."""

    COMPONENT_CLASSES = {"dim", "stall"}
    DEFAULT_CSS = "LatencyView { height: auto; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.latency = Latency()
        self.window_index = 1  # 15 s: steadier than 5 s, fresher than 60 s
        self.snapshot_time: float | None = None
        self.has_work = False

    def show(self, snapshot: EngineSnapshot) -> None:
        self.latency = snapshot.latency
        self.snapshot_time, self.has_work = snapshot.time, bool(snapshot.running or snapshot.waiting)
        self.show_window()
        self.refresh(layout=True)

    def show_window(self) -> None:
        """The window is said in the title, so the figures keep the width of the narrowest pane."""
        windows = self.latency.windows
        seconds = f", last {windows[self.window_index % len(windows)].seconds:.0f} s" if windows else ""
        self.border_title = f"Latency{seconds} (click: window)"

    def stall_note(self, now: float | None = None) -> str | None:
        """Why the engine looks stalled, or None. The engine flags a stall in its snapshot; a step that
        hangs publishes no snapshot at all, so an old snapshot with work in it counts too."""
        now = time.time() if now is None else now
        if self.has_work and self.snapshot_time is not None and now - self.snapshot_time > STALL_S:
            return f"STALLED: no news from the engine for {now - self.snapshot_time:.0f} s"
        if self.latency.stalled:
            since = self.latency.since_last_step
            return "STALLED: work waits, no step " + (f"for {since:.0f} s" if since is not None else "yet")
        return None

    def next_window(self) -> None:
        if self.latency.windows:
            self.window_index = (self.window_index + 1) % len(self.latency.windows)
            self.show_window()
            self.refresh()

    def on_click(self) -> None:
        self.next_window()

    def render(self) -> Text:
        dim = self.get_component_rich_style("dim", partial=True)
        if not self.latency.windows:
            return Text("no latency figures yet", dim)
        w = self.latency.windows[self.window_index % len(self.latency.windows)]
        # Columns of 7 (a figure is at most 6 wide: "999 ms", "12.3 s"): with the count, a row takes 34
        # cells, and the narrowest side pane (40 wide, less border and padding) holds 36.
        text = Text()
        text.append(" " * 6 + "".join(f"{h:>7}" for h in ("p50", "p95", "p99")) + "\n", dim)
        for label, p in (("TTFT", w.ttft), ("ITL", w.itl), ("queue", w.queue)):
            text.append(f"{label:<6}")
            text.append("".join(f"{fmt_seconds(v):>7}" for v in (p.p50, p.p95, p.p99)))
            text.append(f" ({p.count})\n" if p.count else "\n", dim)
        hits = "-" if w.prefix_hit_rate is None else f"{100 * w.prefix_hit_rate:.0f}%"
        rates = [f"prefix hits {hits}", f"preempt {w.preemptions_per_s:.1f}/s", f"abort {w.aborts_per_s:.1f}/s",
                 f"compress {w.compressions_per_s:.1f}/s"]
        text.append_text(wrap_items([Text(r, dim) for r in rates], self.content_size.width, style=dim))
        stall = self.stall_note()
        if stall:
            text.append("\n" + stall, self.get_component_rich_style("stall", partial=True))
        return text


class EnginePanes(Vertical):
    """The panes chat and top share, as one widget with its own layout: throughput sparklines, pool
    and memory gauges, latency, and the event log taking the rest of the height."""

    # Fixed heights for the figures (one-row sparklines); the event log takes what is left and keeps at
    # least two lines. 24 rows show every pane whole (chat's side column at 100×30 has 28).
    DEFAULT_CSS = """
    EnginePanes { height: 1fr; min-height: 24; }
    EnginePanes > #throughput { height: 6; }
    EnginePanes > #gauges { height: 6; }
    EnginePanes > #latency { height: auto; }
    EnginePanes > #events { height: 1fr; min-height: 4; }
    EnginePanes Sparkline { height: 1; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.throughput = Throughput(id="throughput", classes="pane")
        self.latency = LatencyView(id="latency", classes="pane")
        self.gauges = Gauges(id="gauges", classes="pane")
        self.event_log = EventLog(id="event-log")

    def show(self, snapshot: EngineSnapshot, events: list[Event]) -> None:
        self.throughput.show(snapshot)
        self.gauges.show(snapshot)
        self.latency.show(snapshot)
        self.event_log.add(events)

    def compose(self) -> ComposeResult:
        with self.throughput:
            self.throughput.border_title = "Throughput"
        with self.gauges:
            self.gauges.border_title = "KV pool & memory"
        self.latency.show_window()
        yield self.latency
        with Vertical(id="events", classes="pane") as pane:
            pane.border_title = "Engine events"
            yield self.event_log


class SidePanes:
    """For the apps: the container with class `side` (inside #body) hides in a terminal narrower
    than the breakpoint, so the main pane keeps its room; F2 shows or hides it by hand."""

    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]  # Textual sets these classes on the screen
    SIDE_BINDING = Binding("f2", "toggle_side", "Panes",
                           tooltip="Hide or show the side panes (hidden at first in narrow terminals)")
    SIDE_CSS = """
    Screen.-narrow .side { display: none; }
    #body.side-on .side { display: block; }
    #body.side-off .side { display: none; }
    """

    def action_toggle_side(self) -> None:
        shown = self.query_one(".side").display
        self.body.set_class(shown, "side-off")
        self.body.set_class(not shown, "side-on")

    lost: str | None = None  # what the attached server's problem was at the last check

    def connection_problem(self, engine) -> str | None:
        """An attached server's problem (gone, or its engine stopped), said once when it starts and
        once when it clears, so that panes frozen at the server's last state are not read as live.
        A local engine has no such problem (it has no `error`)."""
        problem = getattr(engine, "error", None)
        if problem and not self.lost:
            self.notify(f"{problem}. The panes show its last known state.", severity="error", timeout=10)
        elif self.lost and not problem:
            self.notify("the server answers again", timeout=4)
        self.lost = problem
        return problem


class HelpScreen(ModalScreen):
    """The app's key bindings and any extra notes (chat's slash commands, top's teaching mode)."""

    BINDINGS = [Binding("escape,f1,q,question_mark", "app.pop_screen", "Close help")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen #help-box { width: 80; height: auto; max-height: 90%; padding: 1 2; }
    """

    def __init__(self, title: str, bindings: list[Binding], notes: str = ""):
        super().__init__()
        self.title_text = title
        self.bindings = bindings
        self.notes = notes

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()  # a long explanation wraps inside its own column
        for b in self.bindings:
            shown = " or ".join(self.app.get_key_display(Binding(k.strip(), b.action)) for k in b.key.split(","))
            keys.add_row(shown, b.tooltip or b.description)
        # Said first and on the frame, not only after the notes: a long help is scrolled, and at 80×24 its
        # end is below the fold.
        closing = "Esc, F1 or q closes this help."
        with VerticalScroll(id="help-box", classes="pane") as box:
            box.border_title, box.border_subtitle = "Help", "Esc closes"
            yield Static(Group(Text(self.title_text, "bold"), Text(closing + "\n", "italic"), keys, Text(""),
                               *([Text(self.notes + "\n")] if self.notes else []), Text(closing, "italic")))


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; dismisses with True for y (or Enter), False for n or Esc."""

    BINDINGS = [Binding("y,enter", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Static { width: auto; max-width: 70; height: auto; padding: 1 2; }
    """

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        box = Static(Text.assemble((self.question, "bold"), "\n\ny: yes   n or Esc: no"), classes="pane")
        box.border_title = "Confirm"
        yield box

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


def session_name_widget_id(name: str) -> str:
    """A DOM id for a session name (ids allow letters, digits, '-' and '_')."""
    return "s-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in name)

