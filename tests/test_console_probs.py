"""The probability view (how likely each answer token was) in `zipage chat` and in `zipage top`'s
teaching mode, and footers that offer only the keys that work: its words and levels on entries built
by hand, the screen driven by keys and clicks, screenshots in two themes, and the real engine end to
end, local and attached to a server (a tiny random model)."""

from __future__ import annotations

import asyncio
import math

import pytest
from rich.style import Style
from textual.widgets._footer import FooterKey

from console_helpers import (EVERY_LOOK, KNOBS, ViewHost, click_token, help_text, in_teaching_mode, on_view,
                             send_terminal_bytes, teach_step, terminal_keys, type_line, view_screenshot, view_styles,
                             wait_for)
from console_helpers import engine, remote, server  # noqa: F401 (fixtures)
from zipage.engine.api.thread import EngineThread
from zipage.engine.config import SamplingParams
from zipage.engine.logprobs import TokenLogprobs
from zipage.cli.console.chat import ChatApp
from zipage.cli.console.prob_source import TOP_LOGPROBS, Scored
from zipage.cli.console.prob_view import ProbScreen
from zipage.cli.console.prob_words import alternatives, level, percent, summary, token_line
from zipage.cli.console.top import TopApp

TOL = 1e-4  # a server's engine batches differently from a local one: float32 rounding only
NO_REVERSE = Style(reverse=False)  # the cursor's colours win over high contrast's reverse


def test_f4_as_terminals_send_it_and_alt_p_as_tmux_sends_it():
    assert terminal_keys("\x1bOS") == ["f4"] and terminal_keys("\x1b[14~") == ["f4"]
    assert terminal_keys("\x1bp") == ["alt+p"]


# -- words and levels, on entries built by hand ---------------------------------------------------
PIECES = [" The", " magic", " number", " is", " 482", "13", ".", "\n", "It", " was", " on", " the", " wall", "."]
PROBABILITIES = [0.97, 0.62, 0.95, 0.91, 0.08, 0.35, 0.99, 0.55, 0.3, 0.93, 0.02, 0.96, 0.4, 0.9]
WORDS = {100 + i: piece for i, piece in enumerate(PIECES)} | {900: " door", 901: " roof", 902: " floor"}


def entry(i: int) -> TokenLogprobs:
    """Token i of the answer: its own probability, and three alternatives that share the rest."""
    p = PROBABILITIES[i]
    rest = (1 - p) / 4
    top = dict(sorted({100 + i: math.log(p), 900: math.log(rest * 2), 901: math.log(rest),
                       902: math.log(rest / 2)}.items(), key=lambda kv: -kv[1]))
    rank = 1 + sum(lp > math.log(p) for lp in top.values())
    if i == 10:  # " on" at 2%: not among the three most likely shown
        top.pop(100 + i)
    return TokenLogprobs(100 + i, math.log(p), rank, top)


def scored(done: bool = True) -> Scored:
    return Scored(1, PIECES, [entry(i) for i in range(len(PIECES))], WORDS.get, done)


def test_levels_and_words():
    assert [level(math.log(p)) for p in (1.0, 0.9, 0.89, 0.5, 0.49, 0.1, 0.099, 1e-9)] == [
        "sure", "sure", "likely", "likely", "unsure", "unsure", "rare", "rare"]
    assert [percent(p) for p in (0.934, 0.5, 0.042, 0.0031, 0.00000031, 0.0)] == ["93%", "50%", "4.2%", "0.31%",
                                                                                "<0.001%", "<0.001%"]
    assert token_line(entry(0), 0, " The") == ("answer token 1 ' The' · logprob -0.0305 · probability 97% · "
                                               "the most likely token")
    assert "rank 2: 1 token was more likely" in token_line(entry(8), 8, "It")  # " door" at 35% beat it
    assert token_line(entry(8), 8, None).startswith("answer token 9 id 108 ·")
    rows = alternatives(entry(10), WORDS.get)  # the token given is not among the top: it comes last, marked
    assert [(t, text, given) for t, text, _, given in rows] == [(900, " door", False), (901, " roof", False),
                                                                (902, " floor", False), (110, " on", True)]
    assert summary(scored().entries).startswith("14 tokens (7 ≥90%, 2 50–90%, 3 10–50%, 2 <10%) · mean logprob")


# -- the screen, on entries built by hand ---------------------------------------------------------
class Host(ViewHost):
    """An app that only shows the probability view of an answer built by hand."""

    def view(self) -> ProbScreen:
        return ProbScreen("#1 (chat-1)", scored, refresh_s=3600.0)


def detail_shown(screen: ProbScreen) -> str:
    return " ".join(str(screen.detail.render()).split())


def test_the_cursor_moves_by_keys_and_clicks_and_shows_the_alternatives():
    async def check(pilot, screen):
        assert screen.cursor == 10  # the least likely token
        assert detail_shown(screen).startswith("answer token 11 ' on' · logprob -3.9120 · probability 2.0% · "
                                               "rank 4: 3 tokens were more likely")
        assert "▶ ' on' 2.0%" in detail_shown(screen) and "' door' 49%" in detail_shown(screen)
        await pilot.press("right")
        assert screen.cursor == 11 and "' the' 96%" in detail_shown(screen)
        await pilot.press("home")
        assert screen.cursor == 0 and detail_shown(screen).startswith("answer token 1 ' The'")
        await pilot.press("down")
        assert screen.text.line_of(screen.cursor) == 1  # "It" starts the line after the newline
        await pilot.press("end")
        assert screen.cursor == len(PIECES) - 1
        await click_token(pilot, screen.text, 4)  # " 482"
        assert screen.cursor == 4 and "' 482'" in detail_shown(screen)
        await pilot.press("escape")
        assert not isinstance(screen.app.screen, ProbScreen)

    on_view(Host(), check)


def shading(screen: ProbScreen) -> list[str]:
    """The level each token of the answer is drawn in, read back from the styles of the drawn text."""
    names = {screen.text.style_for(f"prob--{name}"): name for name in ("rare", "unsure", "likely", "sure")}
    drawn = screen.text.render()
    levels, cursor = [], screen.text.style_for("prob--cursor")
    for span in drawn.spans:
        style = span.style
        found = next((name for look, name in names.items() if style in (look, look + cursor + NO_REVERSE)), None)
        if found is not None:
            levels.append(found)
    return levels


def test_the_text_is_shaded_by_each_tokens_probability():
    async def check(pilot, screen):
        assert shading(screen) == [level(math.log(p)) for p in PROBABILITIES]

    on_view(Host(), check)


def test_high_contrast_shades_without_colour():
    """Each level differs by text style, not only by colour: bold, plain, underline, reverse."""
    styles = view_styles(Host("high-contrast"), [f"prob--{name}" for name in ("sure", "likely", "unsure", "rare")])
    looks = [(bool(s.bold), bool(s.underline), bool(s.reverse)) for s in styles]
    assert looks == [(True, False, False), (False, False, False), (False, True, False), (False, False, True)]


@EVERY_LOOK
def test_screenshots(tmp_path, theme, size):
    svg = view_screenshot(Host(theme), size, 4, tmp_path, f"probs-{theme}")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for words in ("How likely each token of #1 (chat-1) was", "90% or more", "under 10%",
                  "answer token 5", "482", "most likely tokens here", "door"):
        assert words in svg, words


# -- the real engine ------------------------------------------------------------------------------
def footer_actions(app) -> set[str]:
    return {key.action for key in app.query(FooterKey)}


def check_view_against(screen: ProbScreen, final) -> None:
    """What the view shows is the engine's TokenLogprobs of the answer, token by token: its shading,
    and the selected token's alternatives with their probabilities."""
    entries = screen.scored.entries
    assert entries == final.logprobs and [e.token_id for e in entries] == final.token_ids
    assert all(len(e.top) == TOP_LOGPROBS for e in entries)
    assert shading(screen) == [level(e.logprob) for e in entries]
    chosen = entries[screen.cursor]
    rows = alternatives(chosen, screen.scored.text_of)
    assert [(t, lp) for t, _, lp, _ in rows][:TOP_LOGPROBS] == list(chosen.top.items())
    for _, _, logprob, _ in rows:
        assert percent(math.exp(logprob)) in detail_shown(screen)


def test_chat_opens_the_view_by_f4_and_by_alt_p_as_tmux_sends_it(engine):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=12)
        async with app.run_test(size=(100, 30)) as pilot:
            session = app.current
            await send_terminal_bytes(pilot, "\x1bp")  # nothing asked yet: it says so
            assert not isinstance(app.screen, ProbScreen)
            assert "ask something first" in " ".join(n.message for n in app._notifications)
            assert "probs" in footer_actions(app)
            await type_line(pilot, "The magic number is 48213.")
            await wait_for(pilot, lambda: session.last_request is not None and not session.busy, what="the answer")
            final = app.book.tracks[session.last_request].handle.result()
            await send_terminal_bytes(pilot, "\x1bOS")  # F4, as an xterm sends it
            await wait_for(pilot, lambda: isinstance(app.screen, ProbScreen), what="the view by F4")
            screen = app.screen
            assert screen.scored.done and len(screen.scored.entries) == 12
            check_view_against(screen, final)
            start = screen.cursor
            await pilot.press("left" if start else "right")
            assert screen.cursor == (start - 1 if start else 1)
            check_view_against(screen, final)
            await send_terminal_bytes(pilot, "\x1b[14~")  # F4 again, as other terminals send it: closes
            assert not isinstance(app.screen, ProbScreen)
            await send_terminal_bytes(pilot, "\x1bp")  # Alt+P, as tmux sends it: ESC then p
            await wait_for(pilot, lambda: isinstance(app.screen, ProbScreen), what="the view by Alt+P")
            assert app.prompt.value == ""  # the message box typed no "p"
            await pilot.press("escape")
            keys = await help_text(app, pilot)
            assert "f4 or alt+p" in keys and "How likely each token" in keys
            assert keys.splitlines()[1].strip() == "Esc, F1 or q closes this help."

    asyncio.run(run())


def test_teaching_mode_shows_how_likely_the_selected_requests_tokens_were(engine):
    prompt = "Hi"  # a short prompt: six steps stay within the KV budget, so nothing is compressed yet

    async def check(app, pilot):
        await pilot.pause()
        assert {"teach", "step", "probs", "kept"} <= footer_actions(app)
        for _ in range(6):
            await teach_step(app, pilot)
        request = app.selected
        await pilot.press("p")
        await wait_for(pilot, lambda: isinstance(app.screen, ProbScreen), what="the view by p")
        screen = app.screen
        entries = screen.scored.entries
        produced = next(r.output_tokens for r in engine.snapshot(fresh=True).requests if r.id == request)
        assert len(entries) == produced > 0 and not screen.scored.done
        # The same request alone on an engine of its own: the same tokens, the same logprobs.
        alone = EngineThread("random:llama-tiny", **KNOBS)
        try:
            messages = [{"role": "user", "content": prompt}]
            twin = alone.submit(messages, SamplingParams(temperature=0.0, max_tokens=len(entries),
                                                         ignore_eos=True, logprobs=TOP_LOGPROBS)).result(120)
        finally:
            alone.close()
        assert [e.token_id for e in entries] == [e.token_id for e in twin.logprobs]
        for mine, theirs in zip(entries, twin.logprobs):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=TOL) and mine.top.keys() == theirs.top.keys()
        assert shading(screen) == [level(e.logprob) for e in entries]
        await pilot.press("q")
        assert not isinstance(app.screen, ProbScreen)
        await pilot.press("t")
        await pilot.pause()
        assert not {"step", "probs"} & footer_actions(app)

    # No logprobs asked: top asks for them.
    in_teaching_mode(engine, prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), check)


# -- attached to a server -------------------------------------------------------------------------
def test_the_attached_monitor_offers_no_teaching_keys_and_the_local_one_does(engine, remote):
    async def run():
        for door, teaching_keys in ((remote, False), (engine, True)):
            app = TopApp(door, None)
            async with app.run_test(size=(120, 36)) as pilot:
                await pilot.pause()
                actions = footer_actions(app)
                assert ("teach" in actions) == teaching_keys
                assert not {"step", "probs"} & actions  # not teaching: neither steps nor the view
                assert {"help", "kept", "latency_window", "quit"} <= actions
                await pilot.press("t")  # attached: nothing happens, and nothing is refused
                await pilot.pause()
                assert door.paused == teaching_keys
                assert ({"step", "probs"} <= footer_actions(app)) == teaching_keys
                keys = await help_text(app, pilot)
                assert ("Teaching mode on/off" in keys) == teaching_keys
                assert ("not available with --attach" in keys) != teaching_keys
                await pilot.press("escape")
            door.resume()

    asyncio.run(run())


def test_remote_engine_forwards_logprobs_as_the_engines_token_logprobs(engine, remote):
    """Token ids to /v1/completions, chat messages to /v1/chat/completions: the outputs carry the same
    TokenLogprobs as the local engine's, streamed beside the ids and whole at the end."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    for prompt in ([5, 6, 7, 8], [{"role": "user", "content": "Name a colour."}]):
        seen = []
        out = remote.submit(prompt, params, on_output=seen.append).result(120)
        local = engine.submit(prompt, params).result(120)
        assert out.token_ids == local.token_ids and len(out.logprobs) == 6
        for mine, theirs in zip(out.logprobs, local.logprobs):
            assert (mine.token_id, mine.rank) == (theirs.token_id, theirs.rank)
            assert mine.logprob == pytest.approx(theirs.logprob, abs=TOL)
            assert list(mine.top) == list(theirs.top)
            assert list(mine.top.values()) == pytest.approx(list(theirs.top.values()), abs=TOL)
        streamed = [e for o in seen if not o.finished for e in o.new_logprobs]
        assert streamed == out.logprobs and [i for o in seen for i in o.new_token_ids] == out.token_ids
    # The chat's answer taught the remote door its tokens' texts: each token decoded alone, as here.
    decode = engine.tokenizer.decode
    assert remote.token_texts
    assert all(text == decode([t], skip_special_tokens=False) for t, text in remote.token_texts.items())
    unasked = remote.submit([5, 6], SamplingParams(max_tokens=2, ignore_eos=True)).result(120)
    assert (unasked.finish_reason, len(unasked.token_ids), unasked.logprobs) == ("length", 2, None)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        remote.submit([5, 6], SamplingParams(max_tokens=2, prompt_logprobs=1))


def test_the_attached_chat_shows_the_same_probabilities_as_the_local_one(engine, remote):
    async def answer_in(door) -> ProbScreen:
        app = ChatApp(door, temperature=0.0, max_tokens=10)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            await type_line(pilot, "Hello there")
            await wait_for(pilot, lambda: session.last_request is not None and not session.busy, what="the answer")
            await pilot.press("f4")
            await wait_for(pilot, lambda: isinstance(app.screen, ProbScreen) and app.screen.scored is not None,
                           what="the view")
            screen = app.screen
            final = app.book.tracks[session.last_request].handle.result()
            check_view_against(screen, final)
            return screen

    local = asyncio.run(answer_in(engine))
    attached = asyncio.run(answer_in(remote))
    assert [e.token_id for e in attached.scored.entries] == [e.token_id for e in local.scored.entries]
    for mine, theirs in zip(attached.scored.entries, local.scored.entries):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=TOL) and list(mine.top) == list(theirs.top)
    assert attached.cursor == local.cursor
    # The alternatives read the same: the server's texts for them are the local tokenizer's.
    for e in local.scored.entries:
        assert [attached.scored.text_of(t) for t in e.top] == [local.scored.text_of(t) for t in e.top]
