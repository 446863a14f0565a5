"""`zipage serve` against clients that send too much, the wrong thing, too slowly or too many at once;
its graceful shutdown; and what /metrics and /health say about a stuck or dead engine (docs/serving.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from serve_helpers import (API_KEY, MODEL, engine_pid, scrape, start_server, stop_server, wait_for,
                           wait_until_idle)

BODY_LIMIT = int(0.01 * 1024 * 1024)  # --max-body-mb 0.01
GOOD_ORIGIN, OTHER_ORIGIN = "http://good.example", "http://other.example"
KEEP_ALIVE_S = 1.0
GRACE_S = 2.0
STALL_S = 1.0
SOCKET_TIMEOUT_S = 60.0
ENDLESS = {"model": MODEL, "prompt": "a long story", "max_tokens": 5000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A small body limit, one allowed web origin, and a short stall threshold for /health."""
    server = start_server(tmp_path_factory.mktemp("limited") / "server.log",
                          extra=["--max-body-mb", "0.01", "--allowed-origins", GOOD_ORIGIN,
                                 "--stall-timeout", str(STALL_S)])
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """A short keep-alive timeout and room for two connections."""
    server = start_server(tmp_path_factory.mktemp("strict") / "server.log",
                          extra=["--keep-alive-timeout", str(KEEP_ALIVE_S), "--max-connections", "2"])
    yield server
    stop_server(server)


@pytest.fixture
def server(tmp_path):
    server = start_server(tmp_path / "server.log", extra=["--shutdown-timeout", str(GRACE_S)])
    yield server
    stop_server(server)


# -- raw HTTP, for what a well-behaved client never sends ---------------------------------------------
def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S)
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def request_head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {API_KEY}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_one_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def status_and_json(response: bytes) -> tuple[int, dict]:
    head, body = response.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# -- body size and content type --------------------------------------------------------------------------
def test_declared_body_over_the_limit_is_refused_unread(limited):
    with connect(limited) as sock:  # the head alone: the server must not wait for the body to answer
        sock.sendall(request_head("POST", "/v1/completions", "Content-Type: application/json",
                                  f"Content-Length: {100 * BODY_LIMIT}"))
        status, body = status_and_json(read_until_closed(sock))
    assert status == 413
    assert body["error"]["code"] == "body_too_large" and body["error"]["type"] == "invalid_request_error"


def test_chunked_body_is_refused_once_its_bytes_pass_the_limit(limited):
    chunk = b"x" * (BODY_LIMIT + 1024)
    with connect(limited) as sock:  # the body never ends: the refusal comes from counting its bytes
        sock.sendall(request_head("POST", "/v1/completions", "Content-Type: application/json",
                                  "Transfer-Encoding: chunked") + b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        status, body = status_and_json(read_until_closed(sock))
    assert status == 413 and body["error"]["code"] == "body_too_large"


def test_chunked_body_under_the_limit_is_served(limited):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with limited.client() as http:
        response = http.post("/v1/completions", content=iter([body[:10], body[10:]]),
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "",
                                          "application/json; charset=latin-1"])
def test_post_that_is_not_json_gets_415(limited, content_type):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    with limited.client() as http:
        response = http.post("/v1/completions", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 415, response.text
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_json_with_a_utf8_charset_is_served(limited):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    with limited.client() as http:
        response = http.post("/v1/completions", content=body,
                             headers={"Content-Type": "application/json; charset=UTF-8"})
    assert response.status_code == 200, response.text


def test_refusals_are_counted_by_reason(limited):
    def refusals(metrics, reason):
        return metrics.get(("zipage_errors_total", (("reason", reason),)), 0.0)

    before = scrape(limited)
    with limited.client() as http:
        assert http.post("/v1/completions", content="{}", headers={"Content-Type": "text/plain"}).status_code == 415
        assert http.post("/v1/completions", json={"prompt": "x" * (2 * BODY_LIMIT)}).status_code == 413
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 3}).status_code == 400
    after = scrape(limited)
    for reason in ("unsupported_media_type", "body_too_large", "bad_request"):
        assert refusals(after, reason) - refusals(before, reason) == 1, reason


# -- CORS ------------------------------------------------------------------------------------------------
def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(server.url + "/v1/chat/completions", timeout=30,
                         headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Headers": "authorization, content-type"})


def test_preflight_from_an_allowed_origin_is_answered_without_a_key(limited):
    response = preflight(limited, GOOD_ORIGIN)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()


def test_only_allowed_origins_get_cors_headers(limited):
    assert "access-control-allow-origin" not in preflight(limited, OTHER_ORIGIN).headers
    with limited.client() as http:
        allowed = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            headers={"Origin": GOOD_ORIGIN})
        other = http.get("/v1/models", headers={"Origin": OTHER_ORIGIN})
    assert allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "x-zipage-request-id" in allowed.headers["access-control-expose-headers"].lower()
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_without_allowed_origins_no_preflight_succeeds(strict):
    response = preflight(strict, GOOD_ORIGIN)
    assert response.status_code >= 400 and "access-control-allow-origin" not in response.headers


# -- slow, idle and too many clients ---------------------------------------------------------------------
def test_idle_keep_alive_connection_is_closed_after_the_timeout(strict):
    with connect(strict) as sock:
        sock.sendall(request_head("GET", "/health"))
        status, _ = status_and_json(read_one_response(sock))
        served = time.monotonic()
        assert status == 200
        assert closed_by_server(sock)  # blocks until the server closes it (the socket's own timeout: 60 s)
        assert time.monotonic() - served >= KEEP_ALIVE_S / 2  # not at once: after the timeout


def test_connection_that_never_sends_a_request_is_closed(strict):
    with connect(strict) as sock:
        assert closed_by_server(sock)


def test_request_head_sent_a_byte_at_a_time_does_not_hold_the_connection(strict):
    """Each byte arrives well within the timeout, but the whole head never does."""
    head = request_head("GET", "/health", *[f"X-Slow-{i}: {'y' * 40}" for i in range(100)])
    with connect(strict) as sock:
        for byte in head[:-4]:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(KEEP_ALIVE_S / 10)
        else:
            pytest.fail("the server kept a connection whose head took far longer than the keep-alive timeout")
        assert closed_by_server(sock)


def test_request_head_that_outgrows_the_buffer_is_refused(strict):
    """A head still unfinished past 16 KiB is refused, however fast its bytes come."""
    with connect(strict) as sock:
        sock.sendall(request_head("GET", "/v1/models")[:-2] + b"X-Large: " + b"z" * 40_000)
        response = read_until_closed(sock)
    assert response.split()[1] == b"400"


def test_requests_over_the_connection_limit_get_503(strict):
    held = []

    def hold_a_connection():
        """A stream that keeps its connection busy; False when the server refused it (a connection of an
        earlier test may not be closed yet)."""
        client = strict.client()
        stream = client.stream("GET", "/zipage/events")
        response = stream.__enter__()
        if response.status_code == 200:
            lines = response.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)
            held.append((client, stream, lines))
            return True
        stream.__exit__(None, None, None)
        client.close()
        return False

    try:
        for _ in range(2):
            wait_for(hold_a_connection, what="a connection under the limit to be served")
        with strict.client() as http:
            assert http.get("/v1/models").status_code == 503
    finally:
        for client, stream, _ in held:
            stream.__exit__(None, None, None)
            client.close()

    def served_again():
        with strict.client() as http:
            return http.get("/v1/models").status_code == 200

    wait_for(served_again, what="the server to serve again once the held connections closed")


# -- graceful shutdown -----------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_shutdown_ends_open_streams_with_an_error_after_the_grace(server, signum):
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=ENDLESS) as response:
            lines = response.iter_lines()
            assert sum(next(lines).startswith("data: ") for _ in range(6)) >= 3
            signalled = time.monotonic()
            server.process.send_signal(signum)
            rest = list(lines)  # the stream ends: it must not hang
            ended = time.monotonic()
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "shutting_down"
    assert ended - signalled >= GRACE_S * 0.9, "the stream was ended before its grace"
    code = server.process.wait(timeout=120)
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM
    log = server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


# -- metrics and health of a stuck or dead engine --------------------------------------------------------
def test_client_that_leaves_is_counted_as_an_abort(limited):
    def counted(metrics):
        return (metrics.get(("zipage_requests_aborted_total", (("reason", "client_disconnected"),)), 0.0),
                metrics.get(("zipage_requests_total", (("finish_reason", "abort"),)), 0.0))

    before = counted(scrape(limited))
    with limited.client() as http:
        with http.stream("POST", "/v1/completions", json=ENDLESS) as response:
            next(response.iter_lines())
    wait_for(lambda: counted(scrape(limited)) == (before[0] + 1, before[1] + 1), what="the abort to be counted")
    wait_until_idle(limited)


def test_health_and_metrics_answer_at_once_while_the_engine_is_stuck(limited):
    pid = engine_pid(limited)
    with limited.client() as http:
        with http.stream("POST", "/v1/completions", json=ENDLESS) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGSTOP)
            try:
                def stalled():
                    health = http.get("/health", timeout=30)
                    return health.status_code == 503 and health.json()["error"]
                error = wait_for(stalled, what="/health to report the stall")
                assert error["code"] == "engine_stalled" and "no engine step" in error["message"]
                metrics = scrape(limited)  # never waits for a snapshot the stopped engine cannot send
                assert metrics[("zipage_engine_alive", ())] == 1
                assert metrics[("zipage_engine_last_step_age_seconds", ())] > STALL_S
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: http.get("/health", timeout=30).status_code == 200, what="/health to recover")
    wait_until_idle(limited)


def test_metrics_show_a_dead_engine_as_dead(server):
    with server.client() as http:
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}).status_code == 200
    live = scrape(server)
    assert live[("zipage_engine_alive", ())] == 1 and ("zipage_requests_running", ()) in live
    assert live[("zipage_engine_last_step_age_seconds", ())] >= 0

    os.kill(engine_pid(server), signal.SIGKILL)
    dead = wait_for(lambda: (m := scrape(server))[("zipage_engine_alive", ())] == 0 and m,
                    what="/metrics to show the engine dead")
    for gauge in ("zipage_requests_running", "zipage_kv_blocks_used", "zipage_engine_last_step_age_seconds"):
        assert (gauge, ()) not in dead, f"{gauge} of a dead engine"
    assert dead[("zipage_generation_tokens_total", ())] >= 3  # lifetime counters stay
    with server.client() as http:
        health = http.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stopped"
