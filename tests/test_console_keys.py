"""Every key of `zipage chat` and `zipage top`, in every state, on the real engine (tiny random model):
no key may end the app, and the keys that guard work (send to all, close, stop, quit) behave."""

from __future__ import annotations

import asyncio

import pytest
from textual.screen import ModalScreen

from console_helpers import send_terminal_bytes, wait_for
from console_helpers import engine  # noqa: F401 (a fixture)
from zipage.cli.console.chat import ChatApp
from zipage.cli.console.top import TopApp
from zipage.cli.console.widgets import ConfirmScreen, HelpScreen


def keys_of(app) -> list[str]:
    """Every key bound by the app, except the ones whose whole job is to quit."""
    return [key.strip() for b in app.BINDINGS if b.action != "quit" for key in b.key.split(",")]


# state name -> (sessions, how many of them answer, text in the message box)
CHAT_STATES = {
    "idle": (2, 0, "hello"),
    "empty input": (2, 0, ""),
    "one session": (1, 0, "hello"),
    "streaming": (2, 1, "hello"),
    "all busy": (2, 2, "hello"),
}


async def put_chat_in(app: ChatApp, pilot, engine, state: str) -> None:
    sessions, busy, text = CHAT_STATES[state]
    while isinstance(app.screen, ModalScreen):
        app.pop_screen()
    while len(app.sessions) > sessions:
        await app.close_session(next(reversed(app.sessions)))
    while len(app.sessions) < sessions:
        await app.open_session()
    for pane_id, session in list(app.sessions.items())[:busy]:
        if not session.busy:
            app.ask(session, "keep answering")  # the engine is paused: the answer stays in flight
    await wait_for(pilot, lambda: all(s.handle is not None for s in list(app.sessions.values())[:busy]),
                   what="the answers to be in flight")
    app.tabs.active = next(iter(app.sessions))
    app.prompt.value = text
    app.prompt.focus()
    await pilot.pause()


@pytest.mark.parametrize("state", list(CHAT_STATES))
def test_no_chat_key_ends_the_app_in_any_state(engine, state):
    async def run():
        engine.pause()
        try:
            app = ChatApp(engine, sessions=2, temperature=0.0, max_tokens=20)
            async with app.run_test(size=(120, 36)) as pilot:
                pressed = []
                for key in keys_of(app):
                    await put_chat_in(app, pilot, engine, state)
                    await pilot.press(key)
                    await pilot.pause()
                    pressed.append(key)
                    assert app.is_running and app.return_code is None, f"{state}: {key} ended the app"
                    if isinstance(app.screen, ModalScreen):
                        await pilot.press("escape")  # help or a confirmation: Esc backs out
                        assert not isinstance(app.screen, ModalScreen), key
                assert {"ctrl+b", "alt+w", "ctrl+c", "escape", "f1"} <= set(pressed)
                app.exit()
            assert app.return_code == 0
        finally:
            engine.resume()

    asyncio.run(run())


def test_send_to_all_with_nothing_to_send_or_nobody_idle_says_so(engine):
    async def run():
        engine.pause()
        try:
            app = ChatApp(engine, sessions=2, temperature=0.0, max_tokens=20)
            async with app.run_test(size=(120, 36)) as pilot:
                await pilot.press("ctrl+b")
                await pilot.pause()
                assert "type a message first" in " ".join(n.message for n in app._notifications)
                await put_chat_in(app, pilot, engine, "all busy")
                app.prompt.value = "for everyone"
                await pilot.press("ctrl+b")
                await pilot.pause()
                assert "every session is busy" in " ".join(n.message for n in app._notifications)
                assert app.prompt.value == "for everyone"  # the typed text is kept
                assert app.is_running
        finally:
            engine.resume()

    asyncio.run(run())


def test_closing_a_session_with_history_asks_first(engine):
    async def run():
        app = ChatApp(engine, sessions=2, temperature=0.0, max_tokens=8)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not session.busy and session.conv.history, what="the answer")
            await pilot.press("ctrl+w")  # deletes a word in the box; never closes a session
            assert len(app.sessions) == 2
            await pilot.press("alt+w")
            assert isinstance(app.screen, ConfirmScreen)
            assert "1 turn will be lost" in app.screen.question
            await pilot.press("n")
            assert len(app.sessions) == 2 and app.current is session
            await pilot.press("alt+w")
            await pilot.press("y")
            await wait_for(pilot, lambda: len(app.sessions) == 1, what="the close")
            assert session not in app.sessions.values()
            await pilot.press("alt+w")  # a session without history closes at once
            await wait_for(pilot, lambda: app.current is not None and app.current.conv.name == "chat-3",
                           what="a fresh session in place of the last one")
            assert not isinstance(app.screen, ModalScreen)

    asyncio.run(run())


def test_up_and_down_recall_earlier_messages(engine):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=4)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            for line in ("first", "second"):
                await pilot.press(*line, "enter")
                await wait_for(pilot, lambda: not session.busy, what="the answer")
            await pilot.press(*"draft")
            await pilot.press("up")
            assert app.prompt.value == "second"
            await pilot.press("up", "up")
            assert app.prompt.value == "first"
            await pilot.press("down")
            assert app.prompt.value == "second"
            await pilot.press("down")
            assert app.prompt.value == "draft"

    asyncio.run(run())


def test_ctrl_c_stops_the_answer_then_twice_quits(engine):
    async def run():
        engine.pause()
        try:
            app = ChatApp(engine, temperature=1.0, max_tokens=500)
            async with app.run_test(size=(120, 36)) as pilot:
                session = app.current
                await pilot.press(*"tell me a story", "enter")
                await wait_for(pilot, lambda: session.handle is not None, what="the submit")
                await pilot.press("ctrl+c")
                await wait_for(pilot, lambda: not session.busy, what="the stopped answer")
                assert app.is_running
                await pilot.press("ctrl+c")
                await pilot.pause()
                assert app.is_running  # the first press with nothing running only warns
                await pilot.press("ctrl+c")
                await wait_for(pilot, lambda: not app.is_running, what="the app to quit")
            assert app.return_code == 0
        finally:
            engine.resume()

    asyncio.run(run())


@pytest.mark.parametrize("teaching", [False, True])
def test_no_top_key_ends_the_app(engine, teaching):
    async def run():
        app = TopApp(engine, teach=teaching)
        async with app.run_test(size=(120, 36)) as pilot:
            engine.submit([1, 2, 3, 4, 5], session="probe")
            for key in keys_of(app):
                await pilot.press(key)
                await app.workers.wait_for_complete()
                await pilot.pause()
                assert app.is_running and app.return_code is None, f"{key} ended the app"
                if isinstance(app.screen, HelpScreen):
                    await pilot.press("escape")
            app.exit()

    asyncio.run(run())
    engine.resume()


def test_alt_chords_as_tmux_sends_them_are_commands_not_text(engine):
    """tmux and Alt-as-Meta terminals send Alt+K as ESC then k: the chat's message box must not type
    the letter, and the chord must reach its command."""
    async def run():
        app = ChatApp(engine, sessions=2)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press(*"draft")
            box = app.focused
            await send_terminal_bytes(pilot, "\x1bk")  # Alt+K: nothing asked yet, so it says so
            assert box.value == "draft"
            assert "ask something first" in " ".join(n.message for n in app._notifications)
            first = app.current
            await send_terminal_bytes(pilot, "\x1b[1;3C")  # Alt+→: the next session
            await wait_for(pilot, lambda: app.current is not first, what="the next session")
            await send_terminal_bytes(pilot, "\x1bw")  # Alt+W: closes the empty session
            await wait_for(pilot, lambda: len(app.sessions) == 1, what="the session closed")
            assert app.focused.value == "draft"  # the one message box typed neither letter

    asyncio.run(run())
