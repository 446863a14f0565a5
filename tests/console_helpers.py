"""Shared by the console tests: engine knobs for a tiny random model whose short answers already get
compressed, the engine and server fixtures (import them into a test module to use them), pilot
helpers, and a host app for the token views (the kept and probability views). Deadlines only turn a
hang into a failure: no test depends on speed."""

from __future__ import annotations

import asyncio
import io
import os
import time
from pathlib import Path

import pytest
from rich.console import Console
from textual.widgets import Static

from serve_helpers import API_KEY, start_server, stop_server, wait_until_idle
from zipage.cli.console.themes import ThemedApp

KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2, num_kv_blocks=64)
HANG_S = 120.0
# Each theme at the console's smallest size and a roomier one: the token views' screenshots.
EVERY_LOOK = pytest.mark.parametrize("theme,size", [pytest.param(theme, size, id=f"{theme}-{size[0]}x{size[1]}")
                                                    for size in ((80, 24), (120, 36))
                                                    for theme in ("dark", "high-contrast")])


@pytest.fixture(scope="module")
def engine():
    """The tiny random model on an engine thread, one per test module."""
    from zipage.engine.api.thread import EngineThread

    service = EngineThread("random:llama-tiny", **KNOBS)
    yield service
    service.resume()
    service.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `zipage serve` process on the tiny model (serve_helpers.py), one per test module."""
    server = start_server(tmp_path_factory.mktemp("server") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture
def remote(server):
    """A console's door to `server`; the test leaves the server idle."""
    from zipage.cli.serve.remote import RemoteEngine

    door = RemoteEngine(server.url, API_KEY)
    yield door
    door.close()
    wait_until_idle(server)


async def wait_for(pilot, condition, timeout: float = HANG_S, what: str = "condition"):
    """Let the app run until `condition()` holds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def type_line(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


async def help_text(app, pilot) -> str:
    """Open the app's help screen (F1) and return what it shows, as plain text."""
    from zipage.cli.console.widgets import HelpScreen

    await pilot.press("f1")
    await pilot.pause()
    assert isinstance(app.screen, HelpScreen)
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(app.screen.query_one("#help-box Static").content)
    return console.export_text()


async def send_terminal_bytes(pilot, data: str) -> None:
    """Send keys exactly as a terminal (or tmux) writes them: the bytes go through Textual's own
    parser, and each key event keeps the character the parser gave it (pilot.press gives an Alt
    chord none, which hides an input that would type it)."""
    from textual._xterm_parser import XTermParser
    from textual.events import Key

    parser = XTermParser()
    for event in [*parser.feed(data), *parser.feed("")]:
        if isinstance(event, Key):
            key = Key(event.key, event.character)
            key.set_sender(pilot.app)
            pilot.app._driver.send_message(key)
            await pilot.pause()


def terminal_keys(data: str) -> list[str]:
    """The keys Textual reads from these bytes, as a terminal (or tmux) sends them."""
    from textual._xterm_parser import XTermParser

    parser = XTermParser()
    return [event.key for event in [*parser.feed(data), *parser.feed("")] if hasattr(event, "key")]


async def teach_step(app, pilot) -> None:
    """One step in `zipage top`'s teaching mode (space), and what it set off."""
    await pilot.press("space")
    await app.workers.wait_for_complete()
    await pilot.pause()


def in_teaching_mode(engine, prompt: str, params, check) -> None:
    """Await `check(app, pilot)` on `zipage top` in teaching mode over a load of `prompt` (one request at a
    time), once the load is queued; then resume the engine and abort what is left."""
    from zipage.cli.console.top import LoadGenerator, TopApp, prompt_source

    load = LoadGenerator(engine, prompt_source(engine, [prompt], 8, 0), params, concurrency=1)

    async def run():
        app = TopApp(engine, load, teach=True)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: engine.paused and app.table.row_count > 0, what="the queued load")
            await check(app, pilot)

    try:
        asyncio.run(run())
    finally:
        engine.resume()
        for r in engine.snapshot(fresh=True).requests:
            engine.abort(r.id)


# -- the token views, on data built by hand --------------------------------------------------------
class ViewHost(ThemedApp):
    """An app that only opens one view over a line of text: a test's subclass builds the screen (`view`)
    and says when it is drawn (`ready`)."""

    def compose(self):
        yield Static("underneath")

    def view(self):
        raise NotImplementedError

    def ready(self, screen) -> bool:
        return True

    async def open(self, pilot):
        screen = self.view()
        self.push_screen(screen)
        await wait_for(pilot, lambda: self.screen is screen and self.ready(screen), what="the view")
        await pilot.pause()
        return screen


def on_view(host: ViewHost, check, size: tuple[int, int] = (80, 24)):
    """Open the host's view at `size`, then await `check(pilot, screen)`: what it returns."""
    async def run():
        async with host.run_test(size=size) as pilot:
            return await check(pilot, await host.open(pilot))

    return asyncio.run(run())


def view_styles(host: ViewHost, names: list[str]) -> list:
    """The looks the host's view gives these component classes of its text."""
    async def read(pilot, screen):
        return [screen.text.style_for(name) for name in names]

    return on_view(host, read)


def view_screenshot(host: ViewHost, size: tuple[int, int], cursor: int, tmp_path, name: str) -> str:
    """The view at `size` with its cursor on token `cursor`, saved as `<name>-<W>x<H>.svg` (in
    $ZIPAGE_SCREENSHOTS where set, to look at): its text."""
    path = Path(os.environ.get("ZIPAGE_SCREENSHOTS") or tmp_path) / f"{name}-{size[0]}x{size[1]}.svg"

    async def shoot(pilot, screen):
        screen.move_to(cursor)
        await pilot.pause()
        host.save_screenshot(str(path))

    on_view(host, shoot, size)
    return path.read_text().replace("&#160;", " ")


async def click_token(pilot, text, position: int) -> None:
    """Click a view's text on the second cell of a token."""
    y = text.line_of(position)
    x = next(s.column for s in text.lines()[y] if s.position == position)
    await pilot.click(text, offset=(x + 1, y))
