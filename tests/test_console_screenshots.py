"""Screenshots of `zipage chat` and `zipage top` on the real default model, taken mid-stream.

`ZIPAGE_SCREENSHOTS=docs pytest tests/test_console_screenshots.py` refreshes docs/chat.svg and
docs/top.svg; otherwise the pictures go to a temporary folder and are only checked.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from console_helpers import type_line, wait_for
from zipage.engine.config import SamplingParams
from zipage.engine.api.thread import EngineThread
from zipage.cli.console.chat import ChatApp, Message
from zipage.cli.console.kept_source import TokenBook
from zipage.cli.console.fit import ItemsLine
from zipage.cli.console.top import TopApp
from zipage.cli.console.widgets import BlockTable, EnginePanes, Gauge

# Small blocks and budget, so compression, prefix sharing and the pool map all show at a glance.
KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=4, num_kv_blocks=160)
TINY_KNOBS = dict(KNOBS, max_cache_blocks_per_seq=2)  # short answers already get compressed


@pytest.fixture(scope="module")
def smol():
    service = EngineThread("smollm2-135m", **KNOBS)
    yield service
    service.close()


@pytest.fixture
def out_dir(tmp_path) -> Path:
    folder = os.environ.get("ZIPAGE_SCREENSHOTS")
    return Path(folder) if folder else tmp_path


def check_svg(path: Path, *needles: str) -> None:
    svg = path.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for needle in needles:
        assert needle.replace(" ", "&#160;") in svg or needle in svg, needle


SIZES = {"80x24": (80, 24), "160x48": (160, 48)}


def name(base: str, size: str) -> str:
    """docs/chat.svg is the large picture; the small one is docs/chat-80x24.svg."""
    return f"{base}.svg" if size == "160x48" else f"{base}-{size}.svg"


@pytest.mark.parametrize("size", list(SIZES))
def test_chat_screenshot(smol, out_dir, size):
    async def run():
        app = ChatApp(smol, sessions=2, temperature=0.0, max_tokens=400)
        async with app.run_test(size=SIZES[size]) as pilot:
            first, second = app.sessions.values()
            await type_line(pilot, "What is the capital of France?")  # typed: the pilot waits for the answer
            await wait_for(pilot, lambda: not first.busy)
            # Asked directly, so both answers are still streaming when the picture is taken.
            app.ask(first, "Write a short story about a robot who learns to paint.")
            app.ask(second, "Write a poem about the sea.")
            await wait_for(pilot, lambda: len(first.view.query(Message).last().text) > 300
                           and len(app.query_one(BlockTable).requests) == 2)
            await pilot.pause(0.3)
            app.save_screenshot(str(out_dir / name("chat", size)))

    asyncio.run(run())
    large = size == "160x48"
    check_svg(out_dir / name("chat", size), "Paris", "chat-2", *(["KV blocks per request", "Latency"] if large else []))


# A shared instruction, so the prompts share their first blocks through the prefix cache.
PREAMBLE = "You are a patient science teacher. Answer briefly, with one analogy. Question: "
QUESTIONS = [PREAMBLE + q for q in ("Why is the sky blue?", "How do bees make honey?", "What is a black hole?",
                                    "Why do cats purr?", "How does a rainbow form?", "Why is the sea salty?")]


@pytest.mark.parametrize("size", list(SIZES))
def test_top_and_teaching_screenshots(smol, out_dir, size):
    # The scene is set by hand, step by step, so it never depends on how fast the engine runs: two
    # requests get compressed first, then four more arrive and share the prompts' prefix blocks.
    for leftover in smol.snapshot(fresh=True).requests:  # the previous picture's requests
        smol.abort(leftover.id)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    book = TokenBook(smol)  # their token ids, so the teaching notes can quote what a compression dropped
    smol.pause()
    try:
        for c in conversations[:2]:
            book.submit(c, params)
        for _ in range(400):
            if sum(1 for r in smol.step_once().requests if r.times_compressed) >= 2:
                break
        for c in conversations[2:]:
            book.submit(c, params)
        snap = smol.step_once()  # their prefill: the shared prefix comes from the cache
        assert sum(1 for r in snap.requests if r.times_compressed) >= 2
        assert sum(1 for r in snap.requests if r.blocks_shared) >= 3
    finally:
        smol.resume()

    async def run():
        app = TopApp(smol, None, teach=True, book=book)  # pauses the engine again at once
        async with app.run_test(size=SIZES[size]) as pilot:
            await wait_for(pilot, lambda: smol.paused and app.table.row_count > 0, what="the paused monitor")
            await pilot.pause(0.3)
            app.save_screenshot(str(out_dir / name("top", size)))
            compressed = [r.id for r in smol.snapshot(fresh=True).requests if r.times_compressed]
            app.table.move_cursor(row=app.table.get_row_index(str(compressed[0])))  # follow a compressed request
            # Step until the picture shows a decode step that recalls the selected request's compression,
            # one that teaching mode saw, so it names the tokens it dropped.
            for _ in range(60):
                await pilot.press("space")
                await app.workers.wait_for_complete()
                await pilot.pause()
                note = " ".join(str(app.query_one("#explain").render()).split())
                if "decode step" in note and "latest compression" in note and "Dropped" in note:
                    break
            await pilot.pause(0.3)
            app.save_screenshot(str(out_dir / name("teach", size)))

    asyncio.run(run())
    check_svg(out_dir / name("top", size), "Block pool", "Requests")
    check_svg(out_dir / name("teach", size), "Teaching mode", "decode step", "latest compression",
              *(["Dropped"] if size == "160x48" else []))  # at 80x24 the line is below the pane's fold


@pytest.mark.parametrize("size", list(SIZES))
def test_kept_view_screenshot(smol, out_dir, size):
    """The kept view of an answer compressed a few times, its cursor on a number the prompt gave."""
    from zipage.cli.console.kept_view import KeptScreen

    for leftover in smol.snapshot(fresh=True).requests:
        smol.abort(leftover.id)

    async def run():
        app = ChatApp(smol, temperature=0.0, max_tokens=400)
        async with app.run_test(size=SIZES[size]) as pilot:
            session = app.current
            smol.pause()
            try:
                await type_line(pilot, "My locker code is 4821. Write a short story about a robot who learns to paint.")
                await wait_for(pilot, lambda: session.handle is not None, what="the submit")
                for _ in range(400):  # by hand, so the picture never depends on the engine's speed
                    if any(r.session == session.conv.name and r.times_compressed >= 3
                           for r in smol.step_once().requests):
                        break
                await pilot.press("f3")
                await wait_for(pilot, lambda: isinstance(app.screen, KeptScreen) and app.screen.holding is not None,
                               what="the kept view")
                screen = app.screen
                pieces = [piece or "" for piece in screen.holding.pieces]
                at = "".join(pieces).index("4821")
                screen.move_to(next(p for p in range(len(pieces)) if len("".join(pieces[:p + 1])) > at))
                await pilot.pause(0.3)
                app.save_screenshot(str(out_dir / name("kept", size)))
                await pilot.press("escape")
            finally:
                smol.abort(session.handle)
                smol.resume()

    asyncio.run(run())
    check_svg(out_dir / name("kept", size), "still holds", "Layers", "held by")


# -- every pane fits -----------------------------------------------------------------------------
# At each size, in each app's default layout, every figure line of every pane is shown whole on one row
# (no figure wrapped onto the next line, none cut at the pane's edge or bottom) and every hint shows.
# The tiny model keeps it quick; the layout does not depend on what the text says.
FIT_SIZES = [(80, 24), (100, 30), (120, 36), (200, 50)]


@pytest.fixture(scope="module")
def tiny():
    service = EngineThread("random:llama-tiny", **TINY_KNOBS)
    yield service
    service.close()


def visible_rows(app, widget) -> list[str]:
    """What the screen shows inside `widget`'s content area, row by row, as the terminal would draw it."""
    geometry = app.screen.find_widget(widget)  # where it is, and what its containers let show of it
    region = geometry.region.shrink(widget.styles.gutter).intersection(geometry.clip)
    strips = app.screen._compositor.render_strips()
    return [strip.crop(region.x, region.right).text for strip in strips[region.y:region.bottom]]


def assert_whole(app, widget, what: str) -> None:
    """Each line the widget draws fits its width and is on screen, whole, on a row of its own."""
    rows = visible_rows(app, widget)
    for line in str(widget.render()).splitlines():
        if line.strip():
            assert len(line.rstrip()) <= widget.content_size.width, f"{what}: {line!r} is wider than its pane"
            assert any(row.rstrip() == line.rstrip() for row in rows), f"{what}: {line!r} is not shown whole: {rows}"


def assert_items_whole(app, line: ItemsLine, what: str) -> None:
    """A line of items: on screen whole, and no item split across two rows."""
    assert_whole(app, line, what)
    shown = "\n".join(visible_rows(app, line))
    for item in line.shown(line.content_size.width).split(" · "):
        assert item in shown, f"{what}: {item!r} is split or missing: {shown!r}"


def on_screen(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def assert_panes_fit(app) -> None:
    """The panes both apps share, where the side column shows."""
    panes = app.query_one(EnginePanes)
    if not app.query_one(".side").display:
        return
    assert_whole(app, panes.latency, "latency")
    for gauge in panes.gauges.query(Gauge):
        assert_whole(app, gauge, f"gauge {gauge.label}")
    for label in (panes.throughput.prefill_label, panes.throughput.decode_label):
        assert_whole(app, label, "throughput")
    assert "click: window" in on_screen(app)
    events = app.query_one("#events")
    assert events.region.bottom <= app.size.height - 1 and events.content_region.height >= 2, "the event log is cut"


@pytest.mark.parametrize("size", FIT_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_chat_pane_fits(tiny, size):
    async def run():
        app = ChatApp(tiny, sessions=2, temperature=0.0, max_tokens=30, system="You answer briefly and kindly.")
        async with app.run_test(size=size) as pilot:
            first, second = app.sessions.values()
            await type_line(pilot, "hello there")
            await wait_for(pilot, lambda: not first.busy and first.view.query(ItemsLine))
            tiny.pause()  # the second answer is held mid-way, so its blocks and the settings' hint show
            try:
                app.ask(second, "a long story please")
                await wait_for(pilot, lambda: second.handle is not None)
                for _ in range(12):
                    tiny.step_once()
                await wait_for(pilot, lambda: app.query_one(BlockTable).requests, what="the blocks pane")
                await pilot.pause(0.3)
                assert_items_whole(app, first.view.query(ItemsLine).last(), "the answer's figures")
                assert_items_whole(app, app.settings, "the settings line")
                assert app.prompt.placeholder.startswith("Message (Enter sends")
                assert app.prompt.placeholder in on_screen(app), "the message box's hint is cut"
                assert_panes_fit(app)
                if app.query_one(".side").display:
                    table = app.query_one(BlockTable)
                    header = str(table.render()).split("\n")[0]
                    assert any(row.rstrip() == header.rstrip() for row in visible_rows(app, table)), header
                await pilot.press("alt+right")
                await pilot.pause()
                assert "answering… (Esc stops)" in app.settings.text
                assert_items_whole(app, app.settings, "the busy session's settings line")
            finally:
                tiny.abort(second.handle)
                tiny.resume()

    asyncio.run(run())


@pytest.mark.parametrize("size", FIT_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_top_pane_fits_in_teaching_mode_after_a_compression(tiny, size):
    for leftover in tiny.snapshot(fresh=True).requests:
        tiny.abort(leftover.id)
    book = TokenBook(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def run():
        app = TopApp(tiny, None, teach=True, book=book)
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: tiny.paused, what="teaching mode")
            for i in range(3):
                book.submit([{"role": "user", "content": f"question {i} about the sea"}], params)
            for _ in range(80):  # by hand, one step per key, until a step compressed the selected request
                await pilot.press("space")
                await app.workers.wait_for_complete()
                await pilot.pause()
                if "was compressed this step" in " ".join(str(app.explain.render()).split()):
                    break
            else:
                raise AssertionError("no compression of the selected request in 80 steps")
            await pilot.pause(0.3)
            shown = on_screen(app)
            assert_items_whole(app, app.explain_hints, "the teaching hints")
            for hint in ("space: ", "t: run freely", "↑/↓ selects", "· free"):
                assert hint in shown, hint
            title = app.explain_pane.border_title
            assert title in shown, "the teaching pane's title is cut"
            # The explanation is whole on screen, or scrolls: its last line then shows at the scroll's end.
            scroll = app.query_one("#explain-scroll")
            last = str(app.explain.render()).rstrip().splitlines()[-1]
            scroll.scroll_end(animate=False)
            await pilot.pause()
            assert any(row.strip() and last.endswith(row.strip()) for row in visible_rows(app, app.explain)), last
            assert_panes_fit(app)
            legend = app.pool.legend(app.pool.LEGEND, app.pool.content_size.width)
            for line in str(legend).splitlines():
                assert line.rstrip() in shown, f"the pool's legend is cut: {line!r}"
            for leftover in tiny.snapshot(fresh=True).requests:
                tiny.abort(leftover.id)

    asyncio.run(run())
