"""Screenshots of `zipage chat` and `zipage top` on the real default model, taken mid-stream.

`ZIPAGE_SCREENSHOTS=docs pytest tests/test_console_screenshots.py` refreshes docs/chat.svg and
docs/top.svg; otherwise the pictures go to a temporary folder and are only checked.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from engine.config import SamplingParams
from engine.service import EngineThread
from zipage_cli.chat import ChatApp, Message
from zipage_cli.top import LoadGenerator, TopApp, prompt_source
from zipage_cli.widgets import BlockTable

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


async def wait_for(pilot, condition, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await pilot.pause(0.05)


async def say(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


def check_svg(path: Path, *needles: str) -> None:
    svg = path.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for needle in needles:
        assert needle.replace(" ", "&#160;") in svg or needle in svg, needle


def test_chat_screenshot(smol, out_dir):
    async def run():
        app = ChatApp(smol, sessions=2, temperature=0.0, max_tokens=300)
        async with app.run_test(size=(150, 44)) as pilot:
            first, second = app.sessions.values()
            await say(pilot, "What is the capital of France?")
            await wait_for(pilot, lambda: not first.busy)
            await say(pilot, "Tell me three fun facts about Paris.")
            await pilot.press("alt+right")
            await say(pilot, "Write a haiku about fast GPUs.")
            await pilot.press("alt+left")
            await wait_for(pilot, lambda: len(app.transcript(first).query(Message).last().text) > 200
                           and len(app.query_one(BlockTable).requests) == 2)
            await pilot.pause(0.3)
            app.save_screenshot(str(out_dir / "chat.svg"))

    asyncio.run(run())
    check_svg(out_dir / "chat.svg", "Paris", "KV blocks per request", "chat-2")


def test_top_screenshot(smol, out_dir):
    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        load = LoadGenerator(smol, prompt_source(smol, None, 40, seed=0), params, concurrency=8)
        app = TopApp(smol, load)
        async with app.run_test(size=(150, 44)) as pilot:
            await wait_for(pilot, lambda: smol.snapshot().totals.get("compressions", 0) >= 4)
            await pilot.press("down", "down")
            await pilot.press("t")
            for _ in range(3):
                await pilot.press("space")
                await app.workers.wait_for_complete()
            await pilot.pause(0.3)
            app.save_screenshot(str(out_dir / "top.svg"))

    asyncio.run(run())
    check_svg(out_dir / "top.svg", "Block pool", "decode step", "TEACHING")
