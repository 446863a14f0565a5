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
from zipage.cli.console.top import TopApp
from zipage.cli.console.widgets import BlockTable

# Small blocks and budget, so compression, prefix sharing and the pool map all show at a glance.
KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=4, num_kv_blocks=160)


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
