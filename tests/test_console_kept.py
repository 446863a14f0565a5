"""The kept view (what a request's KV still holds) in `zipage chat` and `zipage top`, and the teaching
notes that name what a compression dropped: its words and layout on maps built by hand, the screen
driven by keys and clicks, screenshots in two themes, and the real engine end to end (a tiny random
model whose short answers get compressed)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import pytest

from console_helpers import (EVERY_LOOK, ViewHost, click_token, help_text, in_teaching_mode, on_view, teach_step,
                             terminal_keys, type_line, view_screenshot, view_styles, wait_for)
from console_helpers import engine  # noqa: F401 (a fixture)
from kept_helpers import GONE, PIECES, PROMPT_TOKENS, dropping_map, varied_map
from zipage.engine.config import SamplingParams
from zipage.engine.events import Compressed
from zipage.cli.console.chat import ChatApp
from zipage.cli.console.kept_source import Holding, TokenBook, take
from zipage.cli.console.kept_view import KeptScreen
from zipage.cli.console.kept_words import (dropped_layers, dropped_phrases, dropped_sentence, level, reasons_lines,
                                           strip_rows)
from zipage.cli.console.token_view import layout


def test_alt_k_as_tmux_sends_it_and_f3_as_terminals_send_it():
    assert terminal_keys("\x1bk") == ["alt+k"]  # ESC then k: what tmux (and Alt-as-Meta terminals) send
    assert terminal_keys("\x1bOR") == ["f3"] and terminal_keys("\x1b[13~") == ["f3"]


# -- words and numbers, on maps built by hand -----------------------------------------------------
def test_levels_and_the_layer_strip():
    assert [level(s) for s in (0.0, 0.1, 0.49, 0.5, 0.99, 1.0)] == ["gone", "partly", "partly", "mostly", "mostly",
                                                                     "all"]
    kmap = varied_map()
    spans, rows = strip_rows(kmap, kmap.num_positions)  # one cell per position
    assert len(rows) == 6 and all(len(r) == kmap.num_positions for r in rows)
    assert rows[0][3] == 1.0 and rows[5][3] == 0.0  # the prompt is whole in layer 0, gone in the last
    assert rows[5][7] == 0.5  # one of the last layer's two heads keeps " 48213."
    spans, rows = strip_rows(kmap, 4)  # four buckets: means over each
    assert [len(s) for s in spans] == [8, 8, 8, 9]
    assert rows[5][0] == pytest.approx((2 + 0.5) / 8)  # two sinks and half of " 48213."


def test_reasons_layer_by_layer():
    kmap = varied_map()
    assert reasons_lines(kmap, 0) == ["layers 0–5: sink ×2"]
    assert reasons_lines(kmap, min(GONE)) == ["layers 0–5: evicted ×2"]
    lines = reasons_lines(kmap, 7)
    assert lines[0] == "layers 0–1: prompt ×2"
    assert lines[1] == "layers 2–3: score ×1 (0.37–0.47), evicted ×1"  # one line, the range of their scores
    assert lines[-1] == "layer 5: score ×1 (0.67), evicted ×1"  # the score that chose it: 0.1 + 0.07 + 0.5


def test_what_a_compression_dropped_is_named_by_phrase():
    n = len(PIECES)
    drops = {(layer, head): {2, 3} for layer in range(4) for head in range(2)}  # " magic number", layers 0-3
    for head in range(2):
        drops[(0, head)] |= {8}  # " Gulls", layers 0 and 1
        drops[(1, head)] |= {8}
    drops[(0, 1)] |= {9}  # " circled": one head only, so no layer lost it
    after = dropping_map(n, drops)
    assert dropped_layers(None, after)[:10] == [0, 0, 4, 4, 0, 0, 0, 0, 2, 0]
    assert [(p.start, p.end) for p in dropped_phrases(dropped_layers(None, after))] == [(2, 4), (8, 9)]
    assert dropped_sentence(None, after, PIECES) == ("Dropped 'magic number' in 4 of 6 layers, 'Gulls' in 2 of 6 "
                                                     "layers; 3 positions left at least one layer, 0 left the "
                                                     "cache entirely.")
    # Compared with a map before the compression, only what that map still held can be dropped, and
    # positions written after it count as held everywhere.
    later = dropping_map(n + 2, {(layer, head): {2, 3, 8, n} for layer in range(6) for head in range(2)})
    assert dropped_layers(after, later)[:10] == [0, 0, 2, 2, 0, 0, 0, 0, 4, 0] and dropped_layers(after, later)[n] == 6
    words = dropped_sentence(after, later, PIECES + [" more", " text"])
    assert words.startswith("Dropped 'more' in 6 of 6 layers, 'Gulls' in 4 of 6 layers, 'magic number' in 2 of 6")
    assert words.endswith("; 4 positions left at least one layer, 4 left the cache entirely.")
    assert "positions 2–3" in dropped_sentence(None, after, None)  # no texts: the positions instead
    assert dropped_sentence(after, after, PIECES) is None


def test_the_text_wraps_between_tokens_and_starts_the_answer_on_its_own_line():
    lines = layout(["ab", " cd", "\n", "efg", " hijklmnop", "x"], width=8, answer_from=3)
    assert [[s.text for s in line] for line in lines] == [["ab", " cd", "↵"], ["── answer ──"], ["efg"],
                                                          [" hijklmn"], ["op", "x"]]
    assert [s.position for s in lines[3] + lines[4]] == [4, 4, 5]  # a token wider than a line is cut


# -- the screen, on a map built by hand ------------------------------------------------------------
class Host(ViewHost):
    """An app that only shows the kept view over a map built by hand."""

    def __init__(self, theme: str = "dark", kmap=None, refresh_s: float = 3600.0):
        super().__init__(theme)
        self.kmap = kmap or varied_map()
        self.fetches = 0
        self.refresh_s = refresh_s  # no refresh by the clock unless a test asks for one

    def fetch(self):
        self.fetches += 1
        return Holding(1, self.kmap, PIECES, PROMPT_TOKENS, time.time())

    def view(self) -> KeptScreen:
        return KeptScreen(1, "#1 (chat-1)", self.fetch, self.refresh_s)

    def ready(self, screen: KeptScreen) -> bool:
        return screen.holding is not None


def reasons_shown(screen: KeptScreen) -> str:
    return " ".join(str(screen.reasons.render()).split())


def test_the_cursor_moves_by_keys_and_clicks_and_shows_each_layers_reasons():
    async def check(pilot, screen):
        assert screen.cursor == 2  # the first token not held everywhere
        assert reasons_shown(screen).startswith("position 2 ' magic' · prompt · held by 5 of 12")
        await pilot.press("right")
        assert screen.cursor == 3 and "' number'" in reasons_shown(screen)
        await pilot.press("end")
        assert screen.cursor == len(PIECES) - 1 and "answer token 13" in reasons_shown(screen)
        await pilot.press("home", "down")
        assert screen.text.line_of(screen.cursor) == 1
        await pilot.press("up", "left")
        assert screen.cursor == 0 and "layers 0–5: sink ×2" in reasons_shown(screen)
        # A click on a token of the answer's " magic" (gone everywhere) selects it.
        await click_token(pilot, screen.text, min(GONE))
        assert screen.cursor == min(GONE)
        assert "layers 0–5: evicted ×2" in reasons_shown(screen)
        # A click on the strip's first column selects the first position.
        await pilot.click(screen.strip, offset=(screen.strip.label_width(), 0))
        assert screen.cursor == 0
        await pilot.press("escape")
        assert not isinstance(screen.app.screen, KeptScreen)

    on_view(Host(), check)


def test_the_map_is_fetched_when_opened_and_after_a_compression_not_per_frame():
    app = Host()

    async def check(pilot, screen):
        assert app.fetches == 1
        for _ in range(5):
            screen.ask()  # within the second: no fetch
        await app.workers.wait_for_complete()
        assert app.fetches == 1
        screen.engine_events([])  # nothing happened to the request
        other = Compressed(request=9, time=0, blocks_before=3, blocks_after=3, tokens_before=48, tokens_after=32,
                           evicted_per_layer=16, recent_kept=18, times=1, seconds=0.0)
        screen.engine_events([other])
        await app.workers.wait_for_complete()
        assert app.fetches == 1
        screen.engine_events([dataclasses.replace(other, request=1)])
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.fetches == 2

    on_view(app, check)


@EVERY_LOOK
def test_screenshots(tmp_path, theme, size):
    svg = view_screenshot(Host(theme), size, 7, tmp_path, f"kept-{theme}")
    for words in ("What #1 (chat-1) still holds", "Layers × positions", "kept everywhere", "gone everywhere",
                  "position 7", "48213", "answer"):
        assert words in svg, words


def test_high_contrast_shades_without_colour():
    """Gone, partly held, mostly held and kept everywhere differ by text style, not only by colour."""
    styles = view_styles(Host("high-contrast"), [f"kept--{name}" for name in ("gone", "partly", "mostly", "all")])
    looks = [(bool(s.strike), bool(s.underline), bool(s.bold)) for s in styles]
    assert looks == [(True, False, False), (False, True, False), (False, False, False), (False, False, True)]


# -- the real engine ------------------------------------------------------------------------------
def step_until(engine, condition, steps: int = 400):
    """Step a paused engine until the snapshot after a step satisfies `condition`."""
    for _ in range(steps):
        snapshot = engine.step_once()
        if condition(snapshot):
            return snapshot
    raise AssertionError("the engine never got there")


def test_token_book_gives_each_position_its_text(engine):
    book = TokenBook(engine)
    engine.pause()
    try:
        handle = book.submit([{"role": "user", "content": "The magic number is 48213."}],
                             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        step_until(engine, lambda s: any(r.id == handle.id and r.times_compressed for r in s.requests))
        holding = take(engine, book, handle.id)
        assert holding.map.compressions >= 1 and holding.note is None
        prompt = book.prompt_tokens(handle.id)
        assert prompt == len(engine.check_prompt([{"role": "user", "content": "The magic number is 48213."}]))
        assert "".join(holding.pieces[:prompt]).count("The magic number is 48213.") == 1
        assert all(p is not None for p in holding.pieces)
        engine.abort(handle)
        assert isinstance(take(engine, book, handle.id), str)  # ended: no map, a reason
    finally:
        engine.resume()


def test_chat_opens_the_view_by_alt_k_as_tmux_sends_it_and_by_f3(engine):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=300)
        async with app.run_test(size=(100, 30)) as pilot:
            session = app.current
            await pilot.press(*terminal_keys("\x1bk"))  # nothing asked yet: it says so
            await pilot.pause()
            assert not isinstance(app.screen, KeptScreen)
            assert "ask something first" in " ".join(n.message for n in app._notifications)
            engine.pause()
            try:
                await type_line(pilot, "The magic number is 48213.")
                await wait_for(pilot, lambda: session.handle is not None, what="the submit")
                step_until(engine, lambda s: any(r.session == "chat-1" and r.times_compressed for r in s.requests))
                await pilot.press(*terminal_keys("\x1bk"))
                await wait_for(pilot, lambda: isinstance(app.screen, KeptScreen) and app.screen.holding is not None,
                               what="the kept view")
                screen = app.screen
                assert screen.request == session.handle.id and screen.holding.map.compressions >= 1
                text = "".join(p for p in screen.holding.pieces if p)
                assert "The magic number is 48213." in text
                start = screen.cursor
                await pilot.press("right")
                assert screen.cursor == start + 1 and f"position {start + 1} " in reasons_shown(screen)
                assert re.search(r"layers? 0(–1)?: ", reasons_shown(screen))
                # A compression of this request while the view is open brings a fresh map.
                fetched = screen.holding.taken
                step_until(engine, lambda s: any(r.session == "chat-1" and r.times_compressed >= 2
                                                 for r in s.requests))
                await wait_for(pilot, lambda: screen.holding.taken != fetched, what="a fresh map")
                await pilot.press(*terminal_keys("\x1bOR"))  # F3 closes it again
                assert not isinstance(app.screen, KeptScreen)
                await pilot.press("f3")
                await wait_for(pilot, lambda: isinstance(app.screen, KeptScreen), what="the view by F3")
                await pilot.press("escape")
                assert not isinstance(app.screen, KeptScreen)
            finally:
                engine.abort(session.handle) if session.handle else None
                engine.resume()
            await wait_for(pilot, lambda: not session.busy, what="the stopped answer")
            # Its KV is freed now: the view shows the map it showed last, and says so.
            await pilot.press("f3")
            await wait_for(pilot, lambda: isinstance(app.screen, KeptScreen) and app.screen.note is not None,
                           what="the view of an ended request")
            assert app.screen.holding is not None and "showing its last map" in app.screen.note
            await pilot.press("escape")
            keys = await help_text(app, pilot)
            assert "f3 or alt+k" in keys and "still holds" in keys

    asyncio.run(run())


def test_chat_remembers_an_answers_map_at_each_compression_for_after_it_ends(engine):
    """The view was never opened while the answer ran: the map taken after its compression is what
    F3 shows once the answer has ended; an answer never compressed is said to have held everything."""
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=300)
        async with app.run_test(size=(100, 30)) as pilot:
            session = app.current
            engine.pause()
            try:
                await type_line(pilot, "The magic number is 48213.")
                await wait_for(pilot, lambda: session.handle is not None, what="the submit")
                step_until(engine, lambda s: any(r.session == "chat-1" and r.times_compressed for r in s.requests))
                await wait_for(pilot, lambda: session.kept is not None, what="the map taken after the compression")
                assert session.kept.request == session.handle.id and session.kept.map.compressions >= 1
            finally:
                engine.abort(session.handle) if session.handle else None
                engine.resume()
            await wait_for(pilot, lambda: not session.busy, what="the stopped answer")
            await pilot.press("f3")
            await wait_for(pilot, lambda: isinstance(app.screen, KeptScreen) and app.screen.note is not None,
                           what="the view of the ended answer")
            assert app.screen.holding.map.compressions >= 1
            assert "has ended" in app.screen.note and "showing its last map" in app.screen.note
            await pilot.press("escape")
            # A short answer that ends before its first compression: nothing to draw, and it says why.
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: app.current is not session, what="a new session")
            fresh = app.current
            fresh.conv.max_tokens = 2
            await type_line(pilot, "Hi")
            await wait_for(pilot, lambda: fresh.last_request is not None and not fresh.busy, what="the short answer")
            await pilot.press("f3")
            await pilot.pause()
            assert not isinstance(app.screen, KeptScreen)
            assert "never compressed" in " ".join(n.message for n in app._notifications)

    asyncio.run(run())


def test_teaching_mode_names_what_a_compression_dropped_then_shows_what_is_left(engine):
    async def check(app, pilot):
        note = ""
        for _ in range(100):
            await teach_step(app, pilot)
            note = " ".join(str(app.query_one("#explain").render()).split())
            if "was compressed this step" in note:
                break
        found = re.search(r"Dropped '(.+?)' in (\d+)(?:–\d+)? of 2 layers", note)
        assert found, note
        request = app.selected
        text = "".join(p for p in app.book.pieces(request, 400) if p).replace("\n", "↵")
        assert found.group(1).strip("…") in text
        assert re.search(r"\d+ positions? left at least one layer", note)
        await pilot.press("k")
        await wait_for(pilot, lambda: isinstance(app.screen, KeptScreen) and app.screen.holding is not None,
                       what="the kept view")
        assert app.screen.request == request and "prompt" in reasons_shown(app.screen)
        await pilot.press("q")
        assert not isinstance(app.screen, KeptScreen)
        keys = await help_text(app, pilot)
        assert "k or f3" in keys

    in_teaching_mode(engine, "The special magic number for lemon is 48213. Gulls circled above the roofs.",
                     SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), check)
