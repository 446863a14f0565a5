"""`zipage top`: a live monitor of an engine under load, with a step-by-step teaching mode.

A load generator thread keeps the engine busy (synthetic random-token prompts or a JSONL file);
the screen redraws from snapshots a few times a second. Teaching mode pauses the engine and runs
exactly one step per key press, then explains the step by diffing the snapshots around it and
reading the events it produced.
"""

from __future__ import annotations

import itertools
import json
import queue
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static

from zipage.engine.config import SamplingParams
from zipage.engine.events import (Aborted, Admitted, Compressed, EngineSnapshot, Event, Failed, Finished, Preempted,
                                  Prefilled, RequestInfo)
from zipage.engine.api.protocol import FrontDoor
from zipage.cli.console.kept_source import MapMemory, TokenBook, prompt_tokens_of, take
from zipage.cli.console.kept_view import KEPT_HELP, KEPT_TERMS, KeptScreen
from zipage.cli.console.prob_source import AnswerScores, with_logprobs
from zipage.cli.console.prob_view import PROB_HELP, PROB_TERMS, ProbScreen
from zipage.cli.console.themes import ThemedApp
from zipage.cli.console.fit import ItemsLine
from zipage.cli.console.widgets import (PANE_TERMS, EnginePanes, HelpScreen, PoolMap, SidePanes, budget_cell, describe_event,
                                        drain)

if TYPE_CHECKING:  # prompts from a file are checked against a local engine only
    from zipage.engine.api.thread import EngineThread

REFRESH_S = 0.25
TEACH_HINTS = ("space: next step · ↑/↓: follow another request · k: what it still holds · p: how likely its "
               "tokens were · t: run freely")
TEACH_HINTS_SHORT = "space: step · ↑/↓: another request · k: kept · p: probs · t: run freely"  # one line at 80

TEACH_INTRO = ("Teaching mode: the engine is paused. Press space (or n) to run exactly one engine step; "
               "these notes then explain what the scheduler and the compressor did, for the request "
               "selected in the table (↑/↓). Press t to let the engine run freely again.")


# -- load ------------------------------------------------------------------------------
def read_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file, one object with a "prompt" string per line (blank lines skipped)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"prompts file {path!r} not found")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path!r} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"prompts file {path!r} cannot be read: {e.strerror}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ValueError(f'{path} line {number}: expected an object with a non-empty string "prompt" field')
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    return prompts


def synthetic_prompts(tokenizer, input_len: int, seed: int = 0) -> Iterator[list[int]]:
    """Endless prompts of `input_len` random non-special token ids."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []))
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    while True:
        yield [rng.choice(vocab) for _ in range(input_len)]


def check_prompts(engine: EngineThread, texts: list[str], path: str) -> None:
    """Every prompt of the file must be servable (encoding, length), checked before the screen starts;
    the error names the file and the prompt."""
    for number, text in enumerate(texts, start=1):
        prompt = [{"role": "user", "content": text}] if getattr(engine.tokenizer, "chat_template", None) else text
        try:
            engine.check_prompt(prompt)
        except ValueError as e:
            raise ValueError(f"{path}, prompt {number}: {e}") from None


def prompt_source(engine: FrontDoor, texts: list[str] | None, input_len: int, seed: int) -> Iterator:
    """Cycle the given prompts (through the chat template when the model has one), or synthesise."""
    if texts is None:
        return synthetic_prompts(engine.tokenizer, input_len, seed)
    if getattr(engine.tokenizer, "chat_template", None):
        return itertools.cycle([[{"role": "user", "content": t}] for t in texts])
    return itertools.cycle(texts)


class LoadGenerator:
    """Keeps up to `concurrency` requests in flight, starting at most `rate` per second (None: no cap)."""

    def __init__(self, engine: FrontDoor, prompts: Iterable, params: SamplingParams, concurrency: int,
                 rate: float | None = None):
        self.engine, self.prompts, self.params = engine, prompts, params
        self.concurrency, self.rate = concurrency, rate
        self.book = TokenBook(engine)  # the requests' token ids, for the kept view
        self.submitted = 0
        self.error: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="zipage-load", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def run(self) -> None:
        in_flight, next_at = [], time.monotonic()
        for prompt in self.prompts:
            while not self.stop.is_set():
                in_flight = [h for h in in_flight if not h.done]
                if len(in_flight) < self.concurrency and time.monotonic() >= next_at:
                    break
                self.stop.wait(0.02)
            if self.stop.is_set():
                return
            if self.rate:
                next_at = time.monotonic() + 1.0 / self.rate
            try:
                in_flight.append(self.book.submit(prompt, self.params, session=f"load-{self.submitted}"))
            except (ValueError, RuntimeError) as e:
                self.error = str(e)
                return
            self.submitted += 1


# -- teaching notes ----------------------------------------------------------------------
def explain_step(before: EngineSnapshot, after: EngineSnapshot, events: list[Event],
                 selected: int | None, last_compression: dict[int, Event] | None = None,
                 dropped: dict[int, str] | None = None) -> list[str]:
    """Plain-words account of one engine step: what ran, then what happened to `selected`
    (with its latest compression, from `last_compression`, when this step did not compress it, and the
    tokens that compression dropped, from `dropped`)."""
    dropped = dropped or {}
    old = {r.id: r for r in before.requests}
    new = {r.id: r for r in after.requests}
    kinds = Counter(e.kind for e in events)
    decoded = [r for r in after.requests if r.id in old and r.output_tokens > old[r.id].output_tokens
               and not any(e.kind == "prefilled" and e.request == r.id for e in events)]
    if after.step == before.step:
        if not before.requests and not events:
            headline = "Nothing to do: no request is waiting or running."
        else:
            headline = ("No forward pass this step: the scheduler only moved requests around "
                        "(a compression started or landed, or requests were preempted).")
    elif kinds["prefilled"]:
        headline = (f"Step {after.step} was a prefill step: {kinds['prefilled']} prompt(s) were computed "
                    "in one pass and their first tokens sampled.")
    else:
        headline = (f"Step {after.step} was a decode step: {len(decoded)} running request(s) each "
                    "produced one token.")
    pool = after.pool
    lines = [headline,
             f"Scheduler: {after.running} running, {after.waiting} waiting; {pool.free} of {pool.total} blocks free "
             f"({pool.cached} of them caching a prefix); query slots {pool.query_slots_used}/{pool.query_slots_total}."]
    target = selected if selected in old or selected in new or any(e.request == selected for e in events) else None
    if target is None and (new or old):
        target = min(new or old)
    if target is not None:
        mine = [e for e in events if e.request == target]
        lines.append("")
        lines += explain_request(target, old.get(target), new.get(target), mine, pool.block_size,
                                 dropped.get(target))
        earlier = (last_compression or {}).get(target)
        if earlier is not None and not any(e.kind == "compressed" for e in mine) and target in new:
            lines.append(f"#{target}'s latest compression (its {_nth(earlier.times)}): " + compression_words(earlier))
            lines.append("   " + compression_reason(target, earlier))
            if dropped.get(target):
                lines.append("   " + dropped[target])
    others = [e for e in events if e.request != target]
    if others:
        lines.append("")
        lines += [f"Also #{e.request}: {describe_event(e)}." for e in others[:6]]
        if len(others) > 6:
            lines.append(f"… and {len(others) - 6} more events.")
    return lines


def explain_request(rid: int, before: RequestInfo | None, after: RequestInfo | None, events: list[Event],
                    block_size: int, dropped: str | None = None) -> list[str]:
    lines = []
    for e in events:
        match e:
            case Admitted(prompt_tokens=prompt, blocks=blocks, cached_tokens=cached):
                lines.append(f"#{rid} was admitted: its {prompt}-token prompt got {blocks} block(s) of {block_size} "
                             "slots" + (f", {cached} tokens reused from the prefix cache." if cached else "."))
            case Prefilled(tokens=tokens, seconds=seconds):
                lines.append(f"#{rid} was prefilled: {tokens} tokens computed in one pass "
                             f"({1000 * seconds:.0f} ms), and its first answer token sampled.")
            case Compressed():
                held = after.block_table if after else ()
                targets = [b for b, role in zip(held, after.block_roles) if role == "target"] if after else []
                decode = [b for b, role in zip(held, after.block_roles) if role == "decode"] if after else []
                lines.append(f"#{rid} was compressed this step: " + compression_words(e))
                lines.append("   " + compression_reason(rid, e))
                if dropped:
                    lines.append("   " + dropped)
                if targets:
                    lines.append(f"   Blocks {_ids(targets)} now hold the kept tokens (compression targets)"
                                 + (f"; block {_ids(decode)} takes the next tokens." if decode else "."))
            case Preempted():
                lines.append(f"#{rid} was preempted: the pool ran out of free blocks, so its blocks were freed and "
                             "it went back to the waiting queue, to be recomputed once blocks free up.")
            case Finished() | Aborted() | Failed():
                lines.append(f"#{rid} {describe_event(e)}; its blocks went back to the pool "
                             "(full ones stay findable by the prefix cache until reused).")
    if after is None or any(e.kind in ("finished", "aborted", "error", "preempted") for e in events):
        return lines or [f"#{rid} is no longer in the engine."]
    if before is not None:
        lines += _progress(rid, before, after, events, block_size)
    if after.status == "waiting" and not events:
        lines.append(f"#{rid} is waiting for admission: there are not enough free blocks for its prompt yet, "
                     "or the batch is full.")
    elif after.status == "compressing":
        lines.append(f"#{rid} is being compressed in the background; it skips decode steps until the "
                     "compaction lands.")
    return lines or [f"#{rid} did not run this step."]


def _progress(rid: int, before: RequestInfo, after: RequestInfo, events: list[Event], block_size: int) -> list[str]:
    """What a decode step did to one request: the slot it wrote, a new block, a query slot."""
    lines = []
    prefilled = any(e.kind == "prefilled" for e in events)
    if after.output_tokens > before.output_tokens and not prefilled:
        position = after.kv_len - 1  # the step stored the K/V of the token fed in, at the cache's end
        block = after.block_table[position // block_size]
        lines.append(f"#{rid} decoded one token (answer token {after.output_tokens}); the step wrote the K/V of "
                     f"the token it read into block {block}, slot {position % block_size} of {block_size} "
                     f"({after.kv_len} tokens cached).")
    elif after.status == "running" and after.output_tokens == before.output_tokens and not prefilled:
        lines.append(f"#{rid} sat this step out (prefill steps run prompts only).")
    if after.kv_len < before.kv_len and not any(e.kind == "compressed" for e in events):
        lines.append(f"#{rid}'s cache went from {before.kv_len} to {after.kv_len} entries: a compression of it "
                     "landed (it ran in the background).")
    grown = [b for b in after.block_table if b not in before.block_table]
    if grown and not any(e.kind in ("admitted", "compressed") for e in events):
        lines.append(f"#{rid} got new block {_ids(grown)}: its last block was full "
                     f"(now {len(after.block_table)} blocks).")
    if before.query_slot is None and after.query_slot is not None:
        lines.append(f"#{rid} got query slot {after.query_slot}: the queries of its last window positions are "
                     "now kept, so it can be scored and compressed when it reaches its block budget (under "
                     "elastic budgets: when the pool runs short).")
    return lines


def compression_words(c: Compressed) -> str:
    """One compression: entries evicted and kept (the prompt, the newest, by score), blocks."""
    prompt = min(c.prompt_kept, c.tokens_after)
    recent = min(c.recent_kept, c.tokens_after - prompt)
    by_score = c.tokens_after - prompt - recent
    return (f"every layer and KV head evicted {c.evicted_per_layer} of its {c.tokens_before} cached "
            f"entries and kept {c.tokens_after}: " + (f"its first {prompt} (the prompt), " if prompt else "")
            + f"the {recent} newest, plus the {by_score} older ones "
            f"that scored highest. Its block table went from {c.blocks_before} to {c.blocks_after} blocks"
            + (" (the same count: the kept entries were packed into target blocks and one fresh block takes "
               "the next tokens)" if c.blocks_before == c.blocks_after else "")
            + f"; {1000 * c.seconds:.1f} ms.")


def compression_reason(rid: int, c: Compressed) -> str:
    """Why a compression ran: the request reached its budget, or (elastic budgets) the pool was short
    and compressing it stood in for a preemption (docs/design-notes.md, "Budgets")."""
    n = c.budget_blocks  # 0: unknown (an older server's event)
    blocks = f" of {n} block{'s' if n != 1 else ''}" if n else ""
    if c.reason == "pool":
        return (f"Why: the pool was short of free blocks, so #{rid} was compressed from {c.blocks_before} blocks "
                f"down to its floor{blocks} instead of anyone being preempted.")
    return f"Why: it reached its KV budget{blocks}, so it was compressed back to it."


def _nth(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _ids(blocks: list[int]) -> str:
    return ", ".join(str(b) for b in blocks)


# -- the app -----------------------------------------------------------------------------
COLUMNS = ("id", "session", "status", "prompt", "output", "kv", "budget/held", "shared", "compr.", "q-slot",
           "tok/s")


def row_cells(r: RequestInfo) -> tuple:
    return (str(r.id), r.session or "-", r.status, r.prompt_tokens, r.output_tokens, r.kv_len, budget_cell(r),
            r.blocks_shared, r.times_compressed, "-" if r.query_slot is None else r.query_slot,
            f"{r.tokens_per_s:.1f}")


class TopApp(SidePanes, ThemedApp):
    TITLE = "Zipage top"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    ENABLE_COMMAND_PALETTE = False
    CSS = SidePanes.SIDE_CSS + """
    #left { width: 2fr; }
    #right { width: 1fr; min-width: 40; max-width: 60; }
    #requests { height: 1fr; min-height: 5; }
    #pool-pane { height: auto; max-height: 50%; }
    PoolMap { height: auto; }
    #explain-pane { height: 2fr; min-height: 6; display: none; }
    #explain-pane.teaching { display: block; }
    #explain-scroll { height: 1fr; }
    #body.teaching-mode #pool-pane { max-height: 40%; }
    #body.teaching-mode #requests { min-height: 4; }
    """
    BINDINGS = [
        Binding("f1,question_mark", "help", "Help", tooltip="Show keys and what the panes mean"),
        Binding("t", "teach", "Teach", tooltip="Teaching mode on/off: pause the engine, step it by hand"),
        Binding("space,n", "step", "Step", tooltip="Teaching mode: run exactly one engine step and explain it"),
        Binding("k,f3", "kept", "Kept", tooltip=KEPT_HELP),
        Binding("p,f4", "probs", "Probs", tooltip=PROB_HELP + " (teaching mode: the selected request)"),
        Binding("w", "latency_window", "Window", tooltip="Latency pane: switch between the 5, 15 and 60 s windows"),
        SidePanes.SIDE_BINDING,
        ThemedApp.THEME_BINDING,
        Binding("q,ctrl+q,ctrl+c", "quit", "Quit", tooltip="Leave"),
    ]

    def __init__(self, engine: FrontDoor, load: LoadGenerator | None = None, theme_name: str = "dark",
                 teach: bool = False, book: TokenBook | None = None):
        """`book`: the token ids of requests submitted elsewhere in this process (the load's by default),
        so the kept view and the teaching notes can show their text."""
        super().__init__(theme_name)
        self.engine, self.load = engine, load
        self.book = book or (load.book if load is not None else TokenBook(engine))
        if load is not None:  # its answers' logprobs, for teaching mode's probability view (cost: prob_source.py)
            load.params = with_logprobs(load.params)
        self.start_teaching = teach
        self.events: queue.Queue = engine.subscribe()
        self.teach_events: queue.Queue | None = None
        self.stepping = False
        self.last_step: tuple | None = None  # (before, after, events) of the latest taught step
        self.last_compression: dict[int, Event] = {}  # request id -> its latest compression event
        # Teaching mode: kept maps taken around its steps, and what each request's latest compression
        # dropped, in words (None where it cannot say).
        self.memory = MapMemory(engine, self.book)
        self.dropped: dict[int, str | None] = {}

    def compose(self) -> ComposeResult:
        # Kept as attributes: timers and workers reach them even while the help screen is on top.
        self.table = DataTable(id="requests", classes="pane", cursor_type="row", zebra_stripes=True)
        self.pool = PoolMap(id="pool")
        self.explain_pane = Vertical(id="explain-pane", classes="pane")
        self.explain = Static(TEACH_INTRO, id="explain", classes="explain")
        # Below the notes, never scrolled away with them.
        self.explain_hints = ItemsLine(TEACH_HINTS, (TEACH_HINTS_SHORT,), id="explain-hints")
        self.panes = EnginePanes()
        self.event_log, self.latency = self.panes.event_log, self.panes.latency
        self.body = Horizontal(id="body")
        yield Header(icon="▣")
        with self.body:
            with Vertical(id="left"):
                self.table.border_title = "Requests"
                yield self.table
                with Vertical(id="pool-pane", classes="pane") as pane:
                    pane.border_title = "Block pool (colour = request, glyph = role)"
                    yield self.pool
                with self.explain_pane:
                    self.explain_pane.border_title = "Teaching mode: one step per key press"
                    with VerticalScroll(id="explain-scroll"):  # a long explanation scrolls, never cut
                        yield self.explain
                    yield self.explain_hints
            with Vertical(id="right", classes="side"):
                yield self.panes
        yield Footer()

    def on_mount(self) -> None:
        self.table.add_columns(*COLUMNS)
        if self.start_teaching:
            self.action_teach()
        if self.load is not None:
            self.load.start()
        self.refresh_panes()
        self.set_interval(REFRESH_S, self.refresh_panes)
        self.table.focus()

    def on_unmount(self) -> None:
        if self.load is not None:
            self.load.close()
        for q in (self.events, self.teach_events):
            if q is not None:
                self.engine.unsubscribe(q)
        self.engine.resume()  # never leave a paused engine behind

    @property
    def selected(self) -> int | None:
        if not self.table.row_count:
            return None
        return int(self.table.coordinate_to_cell_key((self.table.cursor_row, 0)).row_key.value)

    # -- live panes ----------------------------------------------------------------
    def refresh_panes(self) -> None:
        if not self.screen_stack:  # the app is closing: its screens are gone, its timer not yet stopped
            return
        snapshot = self.engine.snapshot()
        self.show_requests(snapshot)
        self.pool.show(snapshot, self.selected)
        events = drain(self.events)
        if isinstance(self.screen, KeptScreen):
            self.screen.engine_events(events)
        self.last_compression.update((e.request, e) for e in events if e.kind == "compressed")
        self.panes.show(snapshot, events)
        self.event_log.select(self.selected)
        problem = self.connection_problem(self.engine)
        mode = "TEACHING (paused)" if self.engine.paused else "NOT LIVE" if problem else "live"
        load = f" · load: {self.load.submitted} sent" if self.load else ""
        if self.load and self.load.error:
            load += f" (stopped: {self.load.error})"
        self.sub_title = ((f"{problem} · last known: " if problem else "")
                          + f"{snapshot.model} · {snapshot.device} · step {snapshot.step} · {snapshot.running} running, "
                          f"{snapshot.waiting} waiting · {mode}{load}")

    def show_requests(self, snapshot: EngineSnapshot) -> None:
        """Update rows in place so the cursor stays on the same request."""
        table = self.table
        live = {str(r.id): r for r in snapshot.requests}
        for key in [k for k in table.rows if k.value not in live]:
            table.remove_row(key)
        for key, r in live.items():
            if key in table.rows:
                for column, value in zip(table.columns, row_cells(r)):
                    table.update_cell(key, column, value, update_width=True)
            else:
                table.add_row(*row_cells(r), key=key)
        table.border_subtitle = f"{len(live)} live · ↑/↓ selects"

    # -- teaching mode -------------------------------------------------------------
    def action_teach(self) -> None:
        if self.engine.paused:
            self.engine.resume()
            self.engine.unsubscribe(self.teach_events)
            self.teach_events = None
            self.explain_pane.remove_class("teaching")
            self.body.remove_class("teaching-mode")
            self.refresh_bindings()  # the footer drops the keys that work only in teaching mode
        else:
            try:
                self.engine.pause()
            except RuntimeError as e:  # an attached server's engine cannot be held from here
                self.notify(str(e), severity="warning")
                return
            self.teach_events = self.engine.subscribe()
            self.explain.update(TEACH_INTRO)
            self.explain_pane.add_class("teaching")
            self.body.add_class("teaching-mode")
            self.refresh_bindings()

    def action_step(self) -> None:
        if not self.engine.paused:
            self.notify("press t for teaching mode first: it pauses the engine", timeout=2)
            return
        if self.stepping:
            return  # one step per key press: ignore presses while a step is still running
        self.stepping = True
        selected = self.selected
        self.run_worker(lambda: self.step(selected), thread=True, group="step")

    def step(self, selected: int | None) -> None:
        """Worker thread: one engine step, bracketed by snapshots, then its explanation."""
        try:
            before = self.engine.snapshot(fresh=True)
            if selected is not None:
                self.memory.remember(selected)  # what it holds before the step, to name what a compression drops
            drain(self.teach_events)  # events from before this step
            after = self.engine.step_once()
            events = drain(self.teach_events)
            for e in events:
                if e.kind == "compressed":
                    self.dropped[e.request] = self.memory.dropped(e)
        finally:
            self.stepping = False
        self.call_from_thread(self.show_step, (before, after, events))

    def show_step(self, record: tuple) -> None:
        self.last_step = record
        self.last_compression.update((e.request, e) for e in record[2] if e.kind == "compressed")
        self.refresh_panes()
        self.explain_selected()

    def explain_selected(self) -> None:
        """The latest step's explanation, for whichever request is selected now."""
        if self.last_step is None:
            return
        before, after, events = self.last_step
        lines = explain_step(before, after, events, self.selected, self.last_compression, self.dropped)
        text = Text()
        for i, line in enumerate(lines):
            text.append(line + "\n", "bold" if i == 0 else "")
        text.rstrip()
        self.explain.update(text)

    def on_data_table_row_highlighted(self) -> None:
        """A new selection shows at once: its explanation, its blocks in the map, its events."""
        self.explain_selected()
        self.pool.show(self.engine.snapshot(), self.selected)
        self.event_log.select(self.selected)

    # -- the kept view -------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """A key shows in the footer (and works) only where it can: the kept view with an engine that
        answers the kept query, teaching mode with an engine this process can hold (not an attached
        server's), and stepping and the probability view in teaching mode."""
        if action == "kept":
            return self.memory.can_ask
        if action == "teach":
            return self.engine.can_pause
        if action in ("step", "probs"):
            return self.engine.paused
        return True

    def action_probs(self) -> None:
        request = self.selected
        if request is None:
            self.notify("no request to show: select one in the table", timeout=3)
            return
        self.push_screen(ProbScreen(f"#{request}", AnswerScores(self.engine, self.book, request)))

    def action_kept(self) -> None:
        request = self.selected
        if request is None:
            self.notify("no request to show: select one in the table", timeout=3)
            return
        engine, book = self.engine, self.book
        self.push_screen(KeptScreen(request, f"#{request}",
                                    lambda: take(engine, book, request, prompt_tokens_of(engine, request))))

    # -- layout --------------------------------------------------------------------
    def action_latency_window(self) -> None:
        self.latency.next_window()

    def action_help(self) -> None:
        notes = ("Teaching mode pauses the engine; each step key runs exactly one engine step (normally one "
                 "forward pass) and explains it for the selected request: admission, prefill, which block and slot "
                 "a decoded token went to, new blocks, compressions (blocks before/after, tokens evicted), "
                 "preemptions and finishes, naming the tokens a compression dropped.\n\nThe block pool map draws every KV block: colour = owning "
                 "request (underlined or reversed once colours run out), glyph = role; dim dots are free blocks, "
                 "small squares free blocks that still cache a prefix.\n\n" + PANE_TERMS + "\n\n" + KEPT_TERMS
                 + "\n\n" + PROB_TERMS)
        # ↑/↓ belong to the requests table.
        select = Binding("up,down", "noop", tooltip="Select another request; teaching mode explains it")
        keys = self.BINDINGS[:3] + [select] + self.BINDINGS[3:]
        if not self.engine.can_pause:  # an attached server's engine: no teaching mode, so none of its keys
            keys = [b for b in keys if b.action not in ("teach", "step", "probs")]
            notes = "Teaching mode needs the engine in this process: it is not available with --attach.\n\n" + notes
        self.push_screen(HelpScreen("Zipage top: keys", keys, notes))

