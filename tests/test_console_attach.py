"""`zipage top --attach` and `zipage chat --attach`: the console drawn from a live server process,
driven with Textual's pilot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import openai
import pytest
from textual.widgets._footer import FooterKey
from typer.testing import CliRunner

from zipage.cli.console.chat import ChatApp, Message
from zipage.cli.main import app as cli
from zipage.cli.serve.remote import RemoteEngine
from zipage.cli.console.top import TopApp
from zipage.engine.api.thread import EngineThread
from zipage.engine.config import SamplingParams
from zipage.engine.core.outputs import PromptTooLong
from serve_helpers import (API_KEY, DEADLINE_S, ENGINE_KNOBS, MODEL, engine_pid, free_port, start_server, stop_server,
                           wait_until_idle)
from console_helpers import remote, server  # noqa: F401 (fixtures)


async def until(pilot, condition, what: str):
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await pilot.pause(0.1)


async def ask_endlessly(app, pilot, text: str):
    """Send `text` from the current session, with an answer that runs until stopped: the session."""
    session = app.current
    session.conv.params = lambda: SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True)
    app.prompt.value = text
    await pilot.press("enter")
    return session


def short(session) -> None:
    session.conv.params = lambda: SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def kept_notes(app) -> list[str]:
    """Every notification's message from now on, kept (the app drops its own once they time out)."""
    notes, notify = [], app.notify

    def keep(message, *args, **kwargs):
        notes.append(message)
        return notify(message, *args, **kwargs)

    app.notify = keep
    return notes


def said(notes: list[str], words: str) -> bool:
    return any(words in note for note in notes)


class LongStream:
    """A streaming request from another client, held open until `stop()` closes it."""

    def __init__(self, server, session: str):
        self.server, self.session = server, session
        self.id: int | None = None
        self.started, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        with self.server.client() as http:
            body = {"model": MODEL, "prompt": "watch me", "user": self.session, "max_tokens": 8000,
                    "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                self.id = int(response.headers["x-zipage-request-id"])
                self.started.set()
                for _ in response.iter_lines():
                    if self.done.is_set():
                        return  # closing the stream aborts the request

    def stop(self):
        self.done.set()
        self.thread.join(DEADLINE_S)


def test_top_attached_draws_a_running_servers_requests(server, remote):
    async def run():
        app = TopApp(remote, None)
        async with app.run_test(size=(150, 45)) as pilot:
            stream = LongStream(server, "watched")
            assert stream.started.wait(DEADLINE_S)
            try:
                key = str(stream.id)
                await until(pilot, lambda: key in {k.value for k in app.table.rows}, "the request's row")
                row = app.table.get_row(key)
                assert row[1] == "watched" and row[2] in ("running", "compressing")
                await until(pilot, lambda: any(e.kind == "admitted" and e.request == stream.id
                                               for e in app.event_log.events), "its admission in the event log")
                await until(pilot, lambda: any(e.kind == "compressed" and e.request == stream.id
                                               for e in app.event_log.events), "a compression in the event log")
                assert "running" in app.sub_title and MODEL in app.sub_title
                drawn = app.pool.snapshot  # what the block pool map drew: the server's pool
                assert drawn.pool.total == 64 and drawn.pool.used >= 1

                # Teaching mode cannot hold a server's engine: the footer offers no key for it, and t does
                # nothing (the help says why).
                assert "teach" not in {key.action for key in app.query(FooterKey)}
                await pilot.press("t")
                await pilot.pause()
                assert not remote.paused and not app.explain_pane.has_class("teaching")
            finally:
                stream.stop()
            await until(pilot, lambda: app.table.row_count == 0, "the aborted request to leave the table")
            await until(pilot, lambda: any(e.kind == "aborted" and e.request == stream.id
                                           for e in app.event_log.events), "its abort in the event log")

    asyncio.run(run())
    wait_until_idle(server)


def test_top_attached_shows_what_a_servers_request_still_holds(server, remote):
    """The kept view asks the server (/zipage/requests/{id}/kept); without the token ids, each position
    is drawn as a cell, and the view says why."""
    from zipage.cli.console.kept_view import KeptScreen

    async def run():
        app = TopApp(remote, None)
        async with app.run_test(size=(120, 36)) as pilot:
            stream = LongStream(server, "watched")
            assert stream.started.wait(DEADLINE_S)
            try:
                await until(pilot, lambda: any(r.id == stream.id and r.times_compressed
                                               for r in remote.snapshot().requests), "a compression")
                await until(pilot, lambda: app.selected == stream.id, "the request's row")
                await pilot.press("k")
                await until(pilot, lambda: isinstance(app.screen, KeptScreen) and app.screen.holding is not None,
                            "the kept view")
                holding = app.screen.holding
                assert holding.map.compressions >= 1 and holding.map.num_layers == 2
                assert holding.note and "no token ids" in holding.note
                assert all(p is None for p in holding.pieces)
                assert "held by" in str(app.screen.reasons.render())
                await pilot.press("escape")
                assert not isinstance(app.screen, KeptScreen)
            finally:
                stream.stop()

    asyncio.run(run())
    wait_until_idle(server)


def test_chat_attached_answers_through_the_server(server, remote):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
        expected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                                  max_tokens=12, temperature=0).choices[0].message.content

    async def run():
        app = ChatApp(remote, temperature=0.0, max_tokens=12)
        async with app.run_test(size=(150, 45)) as pilot:
            app.prompt.value = "Hello there"
            await pilot.press("enter")
            await until(pilot, lambda: app.query(".msg-meta"), "the answer to finish")
            session = app.current
            assert session.conv.history == [{"role": "user", "content": "Hello there"},
                                            {"role": "assistant", "content": expected}]
            meta = app.query_one(".msg-meta").text
            assert meta.startswith("12 tokens") and "reached max tokens" in meta

    asyncio.run(run())
    wait_until_idle(server)


def test_remote_engine_submit_abort_and_refusals(server, remote):
    handle = remote.submit("a story", SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True),
                           session="remote")
    pieces = iter(handle)
    next(pieces)
    assert any(r.id == handle.id and r.session == "remote" for r in remote.snapshot(fresh=True).requests)
    remote.abort(handle)
    out = handle.result(DEADLINE_S)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 8000
    wait_until_idle(server)

    with pytest.raises(PromptTooLong, match="max_model_len"):  # the same error as a local engine's
        remote.submit([7] * 9000, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="out of range") as refused:
        remote.submit([999999], SamplingParams(max_tokens=2))
    assert not isinstance(refused.value, PromptTooLong)
    with pytest.raises(RuntimeError, match="teaching mode"):
        remote.pause()
    done = remote.submit([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)).result(DEADLINE_S)
    assert done.finish_reason == "length" and len(done.token_ids) == 4


def test_attach_errors_are_clear(server):
    with pytest.raises(ValueError, match="API key"):
        RemoteEngine(server.url)
    with pytest.raises(ValueError, match="cannot reach"):
        RemoteEngine(f"http://127.0.0.1:{free_port()}", API_KEY)  # nothing listens there
    result = CliRunner().invoke(cli, ["top", "--attach", server.url, "--api-key", API_KEY, "--teach"])
    assert result.exit_code == 2 and "need a local engine" in result.output
    result = CliRunner().invoke(cli, ["top", "--attach", server.url, "--api-key", API_KEY, "--block-size", "16"])
    assert result.exit_code == 2 and "--block-size" in result.output


def test_chat_keeps_a_refused_message_in_the_box(server, remote):
    async def run():
        app = ChatApp(remote)
        notes = kept_notes(app)
        async with app.run_test(size=(150, 45)) as pilot:
            session = await ask_endlessly(app, pilot, "first")
            await until(pilot, lambda: session.handle is not None, "the answer to start")
            app.prompt.value = "second"
            await pilot.press("enter")  # refused: the session is still answering
            assert app.prompt.value == "second" and said(notes, "still answering")
            await pilot.press("escape")
            await until(pilot, lambda: not session.busy, "the stopped answer to end")
            session.conv.history.clear()  # the stopped answer may be long enough to fill the small pool
            short(session)
            await pilot.press("enter")  # now it goes
            assert app.prompt.value == ""
            await until(pilot, lambda: session.conv.history, "the second answer")
            assert session.conv.history[0] == {"role": "user", "content": "second"}

    asyncio.run(run())
    wait_until_idle(server)


@contextlib.contextmanager
def own_server(tmp_path):
    """A server one test may kill and start again on the same port, and a console's client of it
    (`.server`, `.remote`)."""
    own = SimpleNamespace(server=start_server(tmp_path / "first.log"), remote=None, log=tmp_path / "second.log")
    try:
        own.remote = RemoteEngine(own.server.url, API_KEY)
        yield own
    finally:
        if own.remote is not None:
            own.remote.close()
        stop_server(own.server)


def kill_server(own) -> None:
    own.server.process.kill()
    own.server.process.wait(DEADLINE_S)


def restart_server(own) -> None:
    own.server = start_server(own.log, port=int(own.server.url.rsplit(":", 1)[1]))


def test_chat_keeps_the_streamed_answer_when_the_server_dies_and_resends_once_it_is_back(tmp_path):
    async def run(own):
        app = ChatApp(own.remote)
        notes = kept_notes(app)
        async with app.run_test(size=(150, 45)) as pilot:
            session = await ask_endlessly(app, pilot, "a long story")
            reply = session.view.query(".msg-assistant").last()
            await until(pilot, lambda: reply.text not in ("", "…"), "the answer to stream")
            drawn = reply.text
            kill_server(own)
            await until(pilot, lambda: not session.busy, "the broken answer to end")

            assert reply.text.startswith(drawn), "what streamed before the failure stays"
            errors = [m for m in session.view.query(Message) if m.has_class("msg-error")]
            assert len(errors) == 1 and errors[0].text.startswith("error: ")
            assert session.conv.history == []  # a broken answer is not built on
            await until(pilot, lambda: "lost the server" in app.sub_title, "the lost server in the title")

            restart_server(own)
            await until(pilot, lambda: said(notes, "answers again"), "the server to be found again")
            await pilot.press("up")
            assert app.prompt.value == "a long story"
            short(session)
            await pilot.press("enter")
            await until(pilot, lambda: session.conv.history, "the answer from the new server")
            assert session.conv.history[0] == {"role": "user", "content": "a long story"}
            assert "lost" not in app.sub_title

    with own_server(tmp_path) as own:
        asyncio.run(run(own))


def test_top_shows_a_stopped_engine_and_a_lost_server_then_recovers(tmp_path):
    async def run(own):
        app = TopApp(own.remote, None)
        notes = kept_notes(app)
        async with app.run_test(size=(150, 45)) as pilot:
            stream = LongStream(own.server, "watched")
            assert stream.started.wait(DEADLINE_S)
            await until(pilot, lambda: app.table.row_count == 1, "the request's row")
            assert app.sub_title.endswith("live")

            os.kill(engine_pid(own.server), signal.SIGKILL)  # the server stays, its engine is gone
            await until(pilot, lambda: "engine process exited" in app.sub_title, "the stopped engine in the title")
            assert app.sub_title.endswith("NOT LIVE") and said(notes, "last known state")
            stream.stop()

            kill_server(own)
            await until(pilot, lambda: "lost the server" in app.sub_title, "the lost server in the title")

            restart_server(own)
            await until(pilot, lambda: app.sub_title.endswith("live") and "NOT" not in app.sub_title,
                        "the new server's state")
            await until(pilot, lambda: app.table.row_count == 0, "the old engine's request to go")
            assert said(notes, "answers again")

    with own_server(tmp_path) as own:
        asyncio.run(run(own))


class NotZipage(BaseHTTPRequestHandler):
    """Some other web service: every GET gets 200 and a JSON object of its own."""

    def do_GET(self):
        body = json.dumps({"status": "fine", "items": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_attach_to_a_wrong_key_a_bad_url_or_another_service_says_so(server):
    with pytest.raises(ValueError, match="refused the API key"):
        RemoteEngine(server.url, "not-the-key")
    with pytest.raises(ValueError, match="not a valid URL"):
        RemoteEngine("http://[::1", API_KEY)
    other = ThreadingHTTPServer(("127.0.0.1", 0), NotZipage)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{other.server_address[1]}"
        with pytest.raises(ValueError, match="not as a zipage server does"):
            RemoteEngine(url)
        result = CliRunner().invoke(cli, ["top", "--attach", url])
        assert result.exit_code == 2 and "not as a zipage server does" in result.output
    finally:
        other.shutdown()
        other.server_close()


def test_a_request_to_a_hung_server_ends_with_an_error(server, remote, monkeypatch):
    """A server that stops answering (here: its process stopped) never takes the request: submit
    gives up after ACCEPT_TIMEOUT_S instead of leaving the session answering for ever. Once the
    server runs again it serves, and the abandoned request leaves nothing behind."""
    import zipage.cli.serve.remote as remote_module

    monkeypatch.setattr(remote_module, "ACCEPT_TIMEOUT_S", 2.0)
    outcome = []

    def send():
        try:
            outcome.append(remote.submit("hello", SamplingParams(temperature=0.0, max_tokens=4)))
        except RuntimeError as e:
            outcome.append(e)

    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(DEADLINE_S)  # a submit that never gives up fails here rather than hanging the suite
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert not sender.is_alive(), "submit waited for ever on a stopped server"
    assert isinstance(outcome[0], RuntimeError) and "did not take the request" in str(outcome[0])
    done = remote.submit([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)).result(DEADLINE_S)
    assert done.finish_reason == "length" and len(done.token_ids) == 4
    wait_until_idle(server)


def test_chat_attached_shows_each_answers_figures_as_a_local_chat_does(server, remote):
    """Under each answer: first-token time, decode speed, the prompt tokens the prefix cache served (the
    earlier turn) and the compressions, the same line whether the engine is here or behind the server."""
    async def lines_under_answers(engine) -> list[str]:
        app = ChatApp(engine, temperature=0.0, max_tokens=12)
        async with app.run_test(size=(150, 45)) as pilot:
            session = app.current
            for turn, text in enumerate(("Tell me about the sea", "And about rivers")):
                app.prompt.value = text
                await pilot.press("enter")
                await until(pilot, lambda: len(session.view.query(".msg-meta")) == turn + 1, "the answer")
            return [meta.text for meta in session.view.query(".msg-meta")]

    local = EngineThread(MODEL, **ENGINE_KNOBS)  # the server's model and knobs, in this process
    try:
        here = asyncio.run(lines_under_answers(local))
    finally:
        local.close()
    attached = asyncio.run(lines_under_answers(remote))
    figures = re.compile(r"\d+(\.\d+)?")
    assert [figures.sub("N", line) for line in attached] == [figures.sub("N", line) for line in here]
    assert re.match(r"12 tokens · first token after \d+\.\d\d s · then \d+\.\d tok/s · ", attached[0]), attached[0]
    assert re.search(r" · \d+ of \d+ prompt tokens cached · ", attached[1]), attached[1]
    wait_until_idle(server)
