"""Saved chats: every session of `zipage chat` kept in a SQLite file as it goes, reopened with --resume or
the in-app list (Ctrl+O), exported as Markdown or JSON; a file that cannot be read is a clear error, and
--no-save writes nothing. Driven against the real engine on the tiny random model the console tests use."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from console_helpers import HANG_S, engine, help_text, send_terminal_bytes, type_line, wait_for  # noqa: F401 (engine: a fixture)
from zipage.cli.console.chat import ChatApp, Message
from zipage.cli.console.plain_chat import Conversation
from zipage.cli.console.saved.browser import SavedChatsScreen
from zipage.cli.console.saved.export import to_markdown
from zipage.cli.console.saved.saver import ChatSaver
from zipage.cli.console.saved.store import FILE_NAME, SCHEMA_VERSION, ChatStore, SavedChatsError
from zipage.cli.main import app as cli


ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "zipage.cli.main"]
TINY = ["--model", "random:llama-tiny", "--device", "cpu", "--block-size", "16", "--window", "8"]


def cli_env(data: Path) -> dict:
    """A `zipage` command's environment, its saved chats in `data`."""
    return dict(os.environ, PYTHONPATH=str(ROOT), ZIPAGE_DATA=str(data))


@pytest.fixture
def store(tmp_path):
    opened = ChatStore(tmp_path / FILE_NAME)
    yield opened
    opened.close()


def on_disk(path) -> list[tuple[str, str, str]]:
    """(session, role, content) of every saved message, read through a connection of its own, as another
    process would read the file: only what was committed shows."""
    with sqlite3.connect(path) as db:
        return db.execute("SELECT s.name, m.role, m.content FROM messages m JOIN sessions s ON s.id = m.session "
                          "ORDER BY m.id").fetchall()


def saved_turn(store: ChatStore, name: str, question: str, answer: str, **settings) -> int:
    """A session saved as a chat would save it, without an engine: its number."""
    conv = Conversation(name, **settings)
    saver = ChatSaver(store, "random:llama-tiny")
    saver.sent(conv, question, 0)
    conv.record(question, answer)
    saver.answered(conv, answer, "3 tokens · finished", 0)
    return conv.saved_id


def transcript(session) -> list[str]:
    return [m.text for m in session.view.query(Message)]


def test_each_question_is_on_disk_when_sent_and_each_answer_when_it_ends(engine, store):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=8, saver=ChatSaver(store, "tiny"))
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            engine.pause()  # the answer cannot end before the question has been looked for
            try:
                await type_line(pilot, "first question")
                await wait_for(pilot, lambda: session.handle is not None, what="the submit")
                assert on_disk(store.path) == [("chat-1", "user", "first question")]
            finally:
                engine.resume()
            await wait_for(pilot, lambda: not session.busy, what="the answer")
            answer = session.conv.history[-1]["content"]
            assert on_disk(store.path) == [("chat-1", "user", "first question"), ("chat-1", "assistant", answer)]
            meta = session.view.query(".msg-meta").last().text
            assert store.find("chat-1").messages[-1].meta == meta  # the figures shown, kept with the answer

    asyncio.run(run())


def read_until(stream, pattern: bytes, timeout: float = HANG_S) -> bytes:
    """What a child wrote to `stream` until `pattern` (or the deadline: the caller's assert says so)."""
    seen, end = b"", time.monotonic() + timeout
    while pattern not in seen and time.monotonic() < end:
        ready, _, _ = select.select([stream], [], [], 0.1)
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
    return seen


def test_a_turn_survives_the_chat_being_killed_and_resumes(tmp_path):
    env = cli_env(tmp_path)
    chat = subprocess.Popen(CLI + ["chat", "--plain", "--temperature", "0", "--max-tokens", "8", *TINY],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        # Lines are handled in order: /help is answered only once the answer before it has ended.
        chat.stdin.write(b"/system be brief\nhello\n/help\n")
        chat.stdin.flush()
        assert b"/quit" in read_until(chat.stderr, b"/quit"), "the chat never answered"
        chat.send_signal(signal.SIGKILL)  # no clean-up of any kind runs
    finally:
        chat.kill()
        chat.wait()
    saved = on_disk(tmp_path / FILE_NAME)
    assert [row[1] for row in saved] == ["user", "assistant"] and saved[0][2] == "hello"

    done = subprocess.run(CLI + ["chat", "--plain", "--resume", "--temperature", "0", "--max-tokens", "8", *TINY],
                          input=b"and again\n", capture_output=True, env=env, cwd=ROOT, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert b"Resumed chat (saved chat 1): 1 turn." in done.stderr
    rows = on_disk(tmp_path / FILE_NAME)
    assert [(name, role) for name, role, _ in rows] == [("chat", "user"), ("chat", "assistant")] * 2
    assert rows[2][2] == "and again"


def test_resume_restores_the_sessions_their_order_settings_and_transcripts(engine, store):
    async def first_chat():
        app = ChatApp(engine, sessions=3, temperature=0.0, max_tokens=8, saver=ChatSaver(store, "tiny"))
        async with app.run_test(size=(120, 36)) as pilot:
            one, two, three = app.sessions.values()
            await pilot.press("alt+right")  # chat-2: settings only, no message
            for line in ("/system be terse", "/temp 0.5", "/max 6", "/budget 2"):
                await type_line(pilot, line)
            await pilot.press("alt+right")  # chat-3 speaks first, chat-1 after: the tabs' order still holds
            await type_line(pilot, "third tab")
            await wait_for(pilot, lambda: len(three.conv.history) == 2, what="chat-3's answer")
            await pilot.press("alt+right")
            for i, line in enumerate(("first", "second")):
                await type_line(pilot, line)
                await wait_for(pilot, lambda: len(one.conv.history) == 2 * (i + 1), what="chat-1's answer")
            await pilot.press("ctrl+n")  # a fourth, closed before the end: left closed
            await type_line(pilot, "short-lived")
            await wait_for(pilot, lambda: len(app.current.conv.history) == 2, what="chat-4's answer")
            await pilot.press("alt+w")
            assert "stays in the saved chats" in app.screen.question
            await pilot.press("y")
            await wait_for(pilot, lambda: len(app.sessions) == 3, what="the close")
            return [(s.conv.name, s.conv.history, transcript(s)) for s in (one, two, three)]

    before = asyncio.run(first_chat())
    resumed = store.last_run()
    assert [s.name for s in resumed] == ["chat-1", "chat-2", "chat-3"]

    async def second_chat():
        app = ChatApp(engine, temperature=0.7, max_tokens=8, saver=ChatSaver(store, "tiny"), resume=resumed)
        async with app.run_test(size=(120, 36)) as pilot:
            sessions = list(app.sessions.values())
            assert [(s.conv.name, s.conv.history, transcript(s)) for s in sessions] == before
            two = sessions[1].conv
            assert (two.system, two.temperature, two.max_tokens, two.kv_budget) == ("be terse", 0.5, 6, 2)
            assert sessions[0].conv.temperature == 0.0  # what the session had, not this chat's default
            await pilot.press("ctrl+n")
            assert app.current.conv.name == "chat-4"  # new names never clash with resumed ones
            # The resumed conversation goes on; its earlier turns are served by the prefix cache.
            app.tabs.active = next(iter(app.sessions))
            await type_line(pilot, "third")
            one = sessions[0]
            await wait_for(pilot, lambda: len(one.conv.history) == 6, what="the resumed session's answer")
            assert "prompt tokens cached" in one.view.query(".msg-meta").last().text

    asyncio.run(second_chat())
    again = store.last_run()  # the resumed sessions belong to the chat that reopened them
    assert [s.name for s in again] == ["chat-1", "chat-2", "chat-3"]
    assert [m.content for m in again[0].messages if m.role == "user"] == ["first", "second", "third"]


def test_the_saved_chats_list_opens_a_session_with_alt_o_as_tmux_sends_it(engine, store):
    number = saved_turn(store, "old-chat", "what was said", "an answer", system="be kind")

    async def run():
        app = ChatApp(engine, saver=ChatSaver(store, "tiny"))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press(*"draft")
            await send_terminal_bytes(pilot, "\x1bo")  # Alt+O: ESC then o
            assert isinstance(app.screen, SavedChatsScreen)
            assert app.screen.sessions[0].id == number and app.screen.sessions[0].first_question == "what was said"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(app.sessions) == 2, what="the saved session's tab")
            assert app.current.conv.name == "old-chat" and app.current.conv.system == "be kind"
            assert transcript(app.current) == ["what was said", "an answer"]
            assert app.prompt.value == "draft"  # the chord typed nothing
            await send_terminal_bytes(pilot, "\x0f")  # Ctrl+O: the list again; Enter goes to the open tab
            assert isinstance(app.screen, SavedChatsScreen)
            await pilot.press("enter")
            assert len(app.sessions) == 2 and app.current.conv.name == "old-chat"
            await pilot.press("escape")
            assert "saved chats" in (await help_text(app, pilot)).lower()

    asyncio.run(run())


def test_export_as_markdown_and_json(engine, store, tmp_path):
    async def run():
        app = ChatApp(engine, temperature=0.0, max_tokens=6, system="answer in French",
                      saver=ChatSaver(store, "random:llama-tiny"))
        async with app.run_test(size=(120, 36)) as pilot:
            session = app.current
            await type_line(pilot, "bonjour")
            await wait_for(pilot, lambda: not session.busy and session.conv.history, what="the answer")
            await type_line(pilot, f"/export {tmp_path / 'chat.json'}")
            await type_line(pilot, f"/export {tmp_path / 'chat.md'}")
            return session.conv.history, session.view.query(".msg-meta").last().text

    history, meta = asyncio.run(run())
    body = json.loads((tmp_path / "chat.json").read_text())
    assert (body["format"], body["version"], body["name"], body["model"]) == ("zipage-chat", 1, "chat-1",
                                                                             "random:llama-tiny")
    assert body["settings"] == {"temperature": 0.0, "max_tokens": 6, "system": "answer in French", "kv_budget": None}
    assert [{"role": m["role"], "content": m["content"]} for m in body["messages"]] == history
    assert body["messages"][1]["meta"] == meta and body["messages"][0]["created"].startswith("20")
    markdown = (tmp_path / "chat.md").read_text()
    assert markdown == to_markdown(store.find("chat-1"))
    lines = markdown.splitlines()
    assert lines[0] == "# chat-1" and "**System:** answer in French" in lines
    you, model = lines.index("## You"), lines.index("## random:llama-tiny")
    assert lines[you + 2] == "bonjour" and you < model and f"*{meta}*" in lines[model:]

    # From the command line, without loading a model: to standard output, or to a file by its suffix.
    env = {"ZIPAGE_DATA": str(store.path.parent)}
    shown = CliRunner().invoke(cli, ["chat", "--export", "chat-1"], env=env)
    assert shown.exit_code == 0 and shown.stdout == markdown
    written = CliRunner().invoke(cli, ["chat", "--export", "1", "--output", str(tmp_path / "again.json")], env=env)
    assert written.exit_code == 0 and json.loads((tmp_path / "again.json").read_text()) == body
    listed = CliRunner().invoke(cli, ["chat", "--list-saved"], env=env)
    assert listed.exit_code == 0 and "chat-1" in listed.stdout and "bonjour" in listed.stdout
    missing = CliRunner().invoke(cli, ["chat", "--export", "nope"], env=env)
    assert missing.exit_code == 2 and "no saved chat 'nope'" in missing.output


def damaged(path):
    path.write_bytes(b"this is no database, just bytes " * 64)


def newer(path):
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE sessions (id INTEGER PRIMARY KEY, future TEXT)")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")


def foreign(path):
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY)")


@pytest.mark.parametrize("spoil, words", [(damaged, "damaged or not a database"),
                                          (newer, f"newer Zipage (schema {SCHEMA_VERSION + 1}"),
                                          (foreign, "not Zipage's saved chats")], ids=["damaged", "newer", "foreign"])
def test_a_file_that_cannot_be_read_is_a_clear_error_and_stays_as_it_was(tmp_path, spoil, words):
    path = tmp_path / FILE_NAME
    spoil(path)
    kept = path.read_bytes()
    with pytest.raises(SavedChatsError, match=words.replace("(", r"\(")):
        ChatStore(path)
    for args in (["chat", "--list-saved"], ["chat", "--plain", "--resume", *TINY]):
        result = CliRunner().invoke(cli, args, env={"ZIPAGE_DATA": str(tmp_path)}, input="hello\n")
        assert result.exit_code == 2, result.output
        assert words in " ".join(result.output.split()) and "--no-save" in result.output
        assert "Traceback" not in result.output
    assert path.read_bytes() == kept


def test_no_save_writes_nothing(engine, tmp_path):
    data = tmp_path / "data"
    env = cli_env(data)
    done = subprocess.run(CLI + ["chat", "--plain", "--no-save", "--max-tokens", "4", *TINY], input=b"hello\n",
                          capture_output=True, env=env, cwd=ROOT, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(b"\n") == 1  # it answered
    assert not data.exists()
    refused = CliRunner().invoke(cli, ["chat", "--no-save", "--resume"], env={"ZIPAGE_DATA": str(data)})
    assert refused.exit_code == 2 and "leave out --no-save" in refused.output

    async def run():  # the app without a store: nothing to list, and closing says what is lost
        app = ChatApp(engine, max_tokens=4)
        async with app.run_test(size=(100, 30)) as pilot:
            await send_terminal_bytes(pilot, "\x0f")
            assert "saving is off" in " ".join(n.message for n in app._notifications)
            await type_line(pilot, "hi")
            await wait_for(pilot, lambda: app.current.conv.history, what="the answer")
            await pilot.press("alt+w")
            assert "will be lost" in app.screen.question

    asyncio.run(run())
    assert not data.exists()


def test_a_failed_write_is_said_once_and_the_chat_goes_on(store):
    warnings = []
    saver = ChatSaver(store, "tiny", warn=warnings.append)
    conv = Conversation("chat-1")
    store.close()  # as if the disk went away
    saver.sent(conv, "hello", 0)
    saver.answered(conv, "hi", None, 0)
    assert len(warnings) == 1 and "no longer being saved" in warnings[0] and not saver.on
