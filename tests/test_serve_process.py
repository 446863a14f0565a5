"""`zipage serve` keeps its engine in a child process: what happens when that process dies, and that
stopping the server never leaves it behind."""

from __future__ import annotations

import json
import os
import signal

import pytest

from serve_helpers import (MODEL, engine_pid, process_ended, start_server, stop_server, wait_for,
                           wait_until_idle)


@pytest.fixture
def server(tmp_path):
    server = start_server(tmp_path / "server.log")
    yield server
    stop_server(server)


def test_engine_killed_mid_stream_ends_requests_with_an_error_and_health_503(server):
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a long story",
                                                          "max_tokens": 5000, "ignore_eos": True,
                                                          "stream": True}) as response:
            lines = response.iter_lines()
            assert sum(next(lines).startswith("data: ") for _ in range(6)) >= 3
            os.kill(engine_pid(server), signal.SIGKILL)
            rest = list(lines)  # the stream ends: it must not hang
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "engine process" in error["message"]

        health = http.get("/health")
        assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert http.get("/zipage/snapshot").status_code == 200  # the last snapshot known


def test_sigterm_stops_the_engine_process_with_the_server(server):
    pid = engine_pid(server)
    wait_until_idle(server)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 128 + signal.SIGTERM
    # The server waited for it: it is gone already, not left to notice on its own.
    assert process_ended(pid), "the engine process outlived the server"


def test_ctrl_c_stops_the_server_and_its_engine_process(server):
    """Ctrl+C in a terminal reaches the whole process group: the engine ignores it and the server,
    once shut down, stops the engine."""
    pid = engine_pid(server)
    os.kill(pid, signal.SIGINT)
    with server.client() as http:  # the engine still serves
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    server.process.send_signal(signal.SIGINT)
    server.process.wait(timeout=60)
    assert process_ended(pid), "the engine process outlived the server"


def test_engine_process_ends_when_the_server_is_killed(server):
    pid = engine_pid(server)
    server.process.kill()
    server.process.wait(timeout=30)
    wait_for(lambda: process_ended(pid), what="the engine process to notice its server is gone")
