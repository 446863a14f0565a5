"""`zipage chat` driven headless (Textual pilot) against the real engine on a tiny random model."""

from __future__ import annotations

import asyncio
import time

import pytest

from console_helpers import KNOBS, help_text, type_line, wait_for
from zipage.engine.api.thread import EngineThread
from zipage.cli.console.chat import REFRESH_S, ChatApp, Message
from zipage.cli.console.widgets import BlockTable, EventLog, HelpScreen

# Tiny blocks and budget so a short answer already gets compressed.


@pytest.fixture(scope="module")
def engine():
    service = EngineThread("random:llama-tiny", **KNOBS)
    yield service
    service.close()


def replies(app: ChatApp, index: int) -> list[Message]:
    session = list(app.sessions.values())[index]
    return [m for m in session.view.query(Message) if m.has_class("msg-assistant")]


def test_two_sessions_stream_concurrently_and_blocks_come_and_go(engine):
    """Both prompts go in while the engine is paused, so the two answers surely overlap; then the
    engine is stepped by hand, watching the first answer grow while the second streams too."""
    async def run():
        app = ChatApp(engine, sessions=2, temperature=1.0, max_tokens=300)
        async with app.run_test(size=(140, 40)) as pilot:
            first, second = app.sessions.values()
            engine.pause()
            try:
                await type_line(pilot, "hello there")
                await pilot.press("alt+right")
                assert app.current is second
                await type_line(pilot, "another question")
                await wait_for(pilot, lambda: first.handle and second.handle, what="both submits")

                engine.step_once()  # prefill: both requests now hold blocks
                # The pane may still show an older snapshot, taken while both requests were waiting
                # (listed, but holding no blocks yet): wait for one that shows them admitted.
                await wait_for(pilot, lambda: {r.session for r in app.query_one(BlockTable).requests
                                               if r.block_table} == {"chat-1", "chat-2"},
                               what="both requests holding blocks in the block pane")
                table = app.query_one(BlockTable)
                for request in table.requests:
                    assert len(request.block_table) == len(request.block_roles) > 0
                assert "■" in str(table.render())

                partial_texts, live_together = set(), 0
                for _ in range(200):
                    engine.step_once()
                    await pilot.pause(0.06)  # let the workers draw
                    partial_texts.add(replies(app, 0)[0].text)
                    live_together += {r.session for r in engine.snapshot().requests} == {"chat-1", "chat-2"}
                    if len(partial_texts) > 3 and live_together > 3:
                        break
                assert len(partial_texts) > 3, "the first answer should be drawn while it streams"
                assert live_together > 3, "the two answers should stream at the same time"
            finally:
                engine.resume()

            await wait_for(pilot, lambda: not first.busy and not second.busy, what="both answers")
            for index, session in enumerate((first, second)):
                reply = replies(app, index)[0]
                assert session.conv.history[-1] == {"role": "assistant", "content": reply.text}

            # Finished requests leave the block pane at the next refresh, and their blocks the pool.
            await wait_for(pilot, lambda: not app.query_one(BlockTable).requests, what="blocks to vanish")
            assert "no request holds blocks" in str(app.query_one(BlockTable).render())
            kinds = {e.kind for e in app.query_one(EventLog).events}
            assert {"admitted", "prefilled", "finished"} <= kinds

    asyncio.run(run())


def test_multi_turn_history_and_settings_commands(engine):
    async def run():
        app = ChatApp(engine, temperature=0.7, max_tokens=50)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            await type_line(pilot, "/temp 0")
            await type_line(pilot, "/max 12")
            assert (session.conv.temperature, session.conv.max_tokens) == (0.0, 12)
            await type_line(pilot, "/temp hot")
            assert session.conv.temperature == 0.0  # bad value rejected, setting kept
            await type_line(pilot, "first")
            await wait_for(pilot, lambda: not session.busy and len(session.conv.history) == 2)
            await type_line(pilot, "second")
            await wait_for(pilot, lambda: not session.busy and len(session.conv.history) == 4)
            assert [m["role"] for m in session.conv.history] == ["user", "assistant"] * 2
            assert session.conv.messages_for("third")[2] == {"role": "user", "content": "second"}

    asyncio.run(run())


def test_broadcast_and_session_keys(engine):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=20)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("ctrl+n")
            await pilot.press("ctrl+n")
            assert len(app.sessions) == 3
            await pilot.press(*"same for all")
            await pilot.press("ctrl+b")
            await wait_for(pilot, lambda: all(len(s.conv.history) == 2 and not s.busy
                                              for s in app.sessions.values()), what="three answers")
            answers = [s.conv.history[-1]["content"] for s in app.sessions.values()]
            assert len(set(answers)) == 1  # greedy: one prompt, one answer, in every session
            await pilot.press("alt+w", "y")  # a session with history asks before it closes
            await wait_for(pilot, lambda: len(app.sessions) == 2, what="the close")

            await pilot.press("f1")  # the panes keep refreshing under the help screen
            await pilot.pause(3 * REFRESH_S)
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

    asyncio.run(run())


def test_stop_aborts_and_frees_every_block(engine):
    async def run():
        app = ChatApp(engine, temperature=1.0, max_tokens=1500)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            engine.pause()  # hold the answer mid-way, so Esc surely meets it running
            try:
                await type_line(pilot, "a long story please")
                await wait_for(pilot, lambda: session.handle is not None, what="the submit")
                for _ in range(5):
                    engine.step_once()
                assert engine.snapshot(fresh=True).pool.free < engine.snapshot().pool.total
                await pilot.press("escape")
                await wait_for(pilot, lambda: not session.busy, what="the stopped answer")
            finally:
                engine.resume()
            meta = session.view.query(".msg-meta").last()
            assert "stopped" in str(meta.render())
            snap = engine.snapshot(fresh=True)
            assert snap.requests == ()
            assert snap.pool.free == snap.pool.total

    asyncio.run(run())


def test_theme_cycle_restyles_the_screen(engine):
    async def run():
        app = ChatApp(engine, theme_name="dark")
        async with app.run_test(size=(100, 30)) as pilot:
            def look():
                pane = app.query_one("#blocks")
                return app.screen.styles.background, pane.styles.background, pane.styles.border_top

            seen = {app.theme_name: look()}
            for _ in range(3):
                await pilot.press("ctrl+t")
                await pilot.pause()
                seen.setdefault(app.theme_name, look())
            assert list(seen) == ["dark", "light", "high-contrast"]
            assert len({s[0] for s in seen.values()}) == 3, "each theme has its own background"
            assert len({s[1:] for s in seen.values()}) == 3, "and its own pane colours"
            assert app.theme_name == "dark"  # the cycle wraps around
            assert look() == seen["dark"]

    asyncio.run(run())


def test_bad_theme_name_is_rejected(engine):
    with pytest.raises(ValueError, match="unknown theme 'neon'.*dark, light, high-contrast"):
        ChatApp(engine, theme_name="neon")


def test_the_app_draws_first_and_loads_the_model_behind_a_progress_line():
    import threading

    gate = threading.Event()  # holds the load until the test has seen the loading screen

    def start():
        gate.wait(30)
        return EngineThread("random:llama-tiny", **KNOBS)

    async def run():
        app = ChatApp(start, temperature=0.0, max_tokens=4, model_name="random:llama-tiny")
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(2 * REFRESH_S)
            assert app.engine is None and app.tabs.loading
            assert "loading random:llama-tiny…" in str(app.settings.render())
            await pilot.press(*"too early", "enter")  # refused with a toast, the app carries on
            assert "still loading" in " ".join(n.message for n in app._notifications)
            gate.set()
            await wait_for(pilot, lambda: app.engine is not None, what="the model")
            assert not app.tabs.loading and "idle" in str(app.settings.render())
            await pilot.press(*"now", "enter")
            await wait_for(pilot, lambda: len(app.current.conv.history) == 2, what="the answer")
        app.engine.close()

    asyncio.run(run())


def test_a_model_that_fails_to_load_ends_the_app_with_its_message():
    async def run():
        app = ChatApp(lambda: EngineThread("random:nope", device="cpu"))
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: not app.is_running, what="the app to end")
        assert app.return_code == 2 and "unknown random preset 'random:nope'" in app.load_error

    asyncio.run(run())


def test_help_explains_the_panes_terms_and_names_keys_plainly(engine):
    async def run():
        app = ChatApp(engine)
        async with app.run_test(size=(120, 40)) as pilot:
            shown = await help_text(app, pilot)
            for term in ("q-slots", "compressed target", "kv ", "TTFT"):
                assert term in shown, term
            assert "question_mark" not in shown and "ctrl+pagedown, alt+right" not in shown
            # Every key is listed, the message box's ↑/↓ (recall earlier messages) too.
            keys = {line.split("  ")[0].strip() for line in shown.splitlines()}
            assert {"↑", "↓", "f1", "^n", "^b", "esc", "^t", "f2"} <= keys, keys

    asyncio.run(run())


def test_answer_line_gives_first_token_time_and_decode_speed_apart(engine):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=12)
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not session.busy and session.view.query(".msg-meta"), what="the answer")
            meta = session.view.query(".msg-meta").last().text
            assert meta.startswith("12 tokens · first token after ") and " s · then " in meta and "tok/s" in meta

    asyncio.run(run())


def test_newest_message_stays_in_view_after_a_resize(engine):
    async def run():
        app = ChatApp(engine, temperature=1.0, max_tokens=120)
        async with app.run_test(size=(120, 24)) as pilot:
            session = app.current
            for i in range(5):
                await pilot.press(*f"message {i}", "enter")
                await wait_for(pilot, lambda: not session.busy and len(session.conv.history) == 2 * (i + 1))
            await pilot.pause()
            assert session.view.max_scroll_y > 0
            await pilot.resize_terminal(70, 18)
            await pilot.pause()
            await pilot.pause()
            assert session.view.scroll_y == session.view.max_scroll_y > 0
            assert not app.query_one("#side").display  # 70 columns: the transcript gets the width

    asyncio.run(run())


def test_event_lines_are_never_cut():
    from zipage.engine.events import Compressed

    async def run():
        app = ChatApp(EngineThread("random:llama-tiny", **KNOBS))
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                log = app.query_one(EventLog)
                log.add([Compressed(request=7, time=time.time(), blocks_before=9, blocks_after=9, tokens_before=288,
                                    tokens_after=256, evicted_per_layer=32, recent_kept=192, times=1, seconds=0.004)])
                await pilot.pause()
                shown = " ".join(str(log.render()).split())
                assert ("#7 compressed 9→9 blocks, at its budget: 288→256 entries per layer (192 newest + 64 by score), "
                        "4.0 ms") in shown
        finally:
            app.engine.close()

    asyncio.run(run())
