"""Shared by the console tests: engine knobs for a tiny random model whose short answers already get
compressed, and pilot helpers. Deadlines only turn a hang into a failure: no test depends on speed."""

from __future__ import annotations

import io
import time

from rich.console import Console

KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=2, num_kv_blocks=64)
HANG_S = 120.0


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
