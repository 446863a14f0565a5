"""`zipage serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) in front of an engine process.

The engine runs in a child process (engine/api/process.py); this process holds HTTP, tokenizing and
detokenizing, and its event loop receives every request's new tokens once per engine step
(engine_client.py). A client that goes away aborts its request, which frees its blocks.
`/zipage/snapshot`, `/zipage/config` and `/zipage/events` carry what the console panes draw, for
`zipage top|chat --attach`. What a client may send or hold (body size, content type, CORS origins,
timeouts, connections), the graceful shutdown and the health rules are `ServeLimits`, described in
docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import EngineSnapshot, event_to_dict, snapshot_to_dict
from zipage.engine.api.process import EngineGone, EngineProcess
from zipage.cli.serve import openai_protocol as api
from zipage.cli.serve.engine_client import EngineClient, Submitted
from zipage.cli.serve.metrics import CONTENT_TYPE, LatencyTracker, ServerMetrics

OPEN_PATHS = ("/health",)  # reachable without the API key
EVENT_POLL_S = 0.1  # how often /zipage/events forwards new engine events
KEEPALIVE_S = 2.0  # an idle event stream sends a comment this often, so either side notices a dead peer
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "x-zipage-request-id"  # the engine's id of the request, as the console panes show it
SNAPSHOT_REFRESH_S = 1.0  # how often the server asks for a snapshot, so that /metrics and /health never wait for one
SHUTDOWN_BACKSTOP_S = 2.0  # past the grace, how long uvicorn waits for the streams it ended to close
MAX_HEADER_BYTES = 16 * 1024  # a request head still unfinished past this is refused with 400 (h11's default)
MIB = 1024 * 1024


@dataclass(frozen=True)
class ServeLimits:
    """What a client may send or hold, and how the server stops (docs/serving.md)."""

    max_body_bytes: int = 32 * MIB  # a larger body gets 413 before it is read
    allowed_origins: tuple[str, ...] = ()  # web origins that may call the server (CORS); none by default
    keep_alive_s: float = 5.0  # an idle connection, or one slow to send a request head, is closed after this
    max_connections: int | None = 1000  # connections served at once; a request over the limit gets 503
    shutdown_grace_s: float = 5.0  # after SIGTERM or Ctrl+C, open streams get this long to finish
    stall_s: float = 60.0  # /health answers 503 when requests wait and no engine step ended for this long


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_response(e: api.ApiError) -> JSONResponse:
    # A body refused for its size is left unread: the connection closes rather than read the rest of it.
    headers = {"Connection": "close"} if e.status == 413 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# The reason label of zipage_errors_total for an error without a code of its own.
ERROR_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                 413: "body_too_large", 415: "unsupported_media_type", 500: "internal_error", 503: "unavailable"}


def error_reason(e: api.ApiError) -> str:
    return e.code or ERROR_REASONS.get(e.status, str(e.status))


def refuse(e: api.ApiError, metrics: ServerMetrics) -> JSONResponse:
    """The error answer, counted in zipage_errors_total."""
    metrics.count_error(error_reason(e))
    return error_response(e)


class ApiKeyGuard:
    """ASGI middleware: every path but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str, metrics: ServerMetrics):
        self.app, self.expected, self.metrics = app, f"Bearer {api_key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = api.ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                     code="invalid_api_key")
                await refuse(error, self.metrics)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(api.ApiError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes)",
                         code="body_too_large")


def is_json(content_type: str) -> bool:
    """application/json, with at most a UTF-8 charset (the only encoding JSON has)."""
    media, *params = [part.strip().lower().replace(" ", "") for part in content_type.split(";")]
    return media == "application/json" and all(p in ("charset=utf-8", 'charset="utf-8"') for p in params)


class RequestLimits:
    """ASGI middleware: a POST must say it carries JSON, which a web page cannot send to another site
    without a CORS preflight (a text/plain body it can); and no body may pass `max_body_bytes`: a declared
    length over it is refused unread, a chunked body as soon as its bytes pass it."""

    def __init__(self, app, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope["method"], Headers(scope=scope))
        if refusal is not None:
            await refuse(refusal, self.metrics)(scope, receive, send)
            return
        await self.app(scope, self.counting(receive), send)

    def refusal(self, method: str, headers: Headers) -> api.ApiError | None:
        content_type = headers.get("content-type", "")
        if method == "POST" and not is_json(content_type):
            return api.ApiError(415, f"Content-Type {content_type!r}: send the body as application/json",
                                code="unsupported_media_type")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return BodyTooLarge(self.max_body_bytes)
        return None

    def counting(self, receive):
        """`receive`, raising BodyTooLarge (a 413 answer) once the body's bytes pass the limit."""
        limit, received = self.max_body_bytes, 0

        async def receive_counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        return receive_counted


class SnapshotKeeper:
    """The latest engine snapshot, kept recent by asking the engine every SNAPSHOT_REFRESH_S and whenever
    the server's last open request ends: /metrics and /health read it and never wait on an engine that
    may be stuck."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.kept: EngineSnapshot = engine.process.first_snapshot
        self.wanted = asyncio.Event()

    @property
    def latest(self) -> EngineSnapshot:
        """The newest of those asked for and those the engine sent on its own (with a request's end)."""
        sent = self.engine.last_snapshot
        return sent if sent.time > self.kept.time else self.kept

    def adopt(self, snap: EngineSnapshot) -> None:
        if snap.time >= self.kept.time:
            self.kept = snap

    def refresh_soon(self) -> None:
        self.wanted.set()

    def step_age_s(self) -> float | None:
        """Seconds since the engine last finished a step (None before its first): the snapshot's own
        count plus the time since it was taken, so it keeps growing while a stuck engine sends none."""
        since = self.latest.latency.since_last_step
        return None if since is None else since + max(0.0, time.time() - self.latest.time)

    async def run(self) -> None:
        while self.engine.alive:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wanted.wait(), SNAPSHOT_REFRESH_S)
            self.wanted.clear()
            self.adopt(await self.engine.snapshot(fresh=True))


class OpenRequests:
    """The requests this server has in the engine: the pending work /health watches, and what a
    shutdown ends."""

    def __init__(self, on_idle: Callable[[], None]):
        self.ids: set[int] = set()
        self.busy_since: float | None = None
        self.on_idle = on_idle

    def add(self, request_id: int) -> None:
        if not self.ids:
            self.busy_since = time.monotonic()
        self.ids.add(request_id)

    def remove(self, request_id: int) -> None:
        self.ids.discard(request_id)
        if not self.ids and self.busy_since is not None:
            self.busy_since = None
            self.on_idle()

    def busy_for(self) -> float | None:
        return None if self.busy_since is None else time.monotonic() - self.busy_since


class ShutdownGrace:
    """Once the server stops accepting, open requests have `grace_s` to finish; then each one left is
    aborted in the engine and ends with an error (an error event and [DONE] on a stream): closing the
    engine client fails every request it still feeds."""

    def __init__(self, engine: EngineClient, requests: OpenRequests, grace_s: float):
        self.engine, self.requests, self.grace_s = engine, requests, grace_s
        self.over = False
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        if self._timer is None and not self.over:
            self._timer = asyncio.get_running_loop().call_later(self.grace_s, self.end_open_requests)

    def end_open_requests(self) -> None:
        self.over = True
        for request_id in list(self.requests.ids):
            self.engine.abort(request_id)
        self.engine.close()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


@dataclass
class Serving:
    """What every endpoint shares."""

    engine: EngineClient
    metrics: ServerMetrics
    snapshots: SnapshotKeeper
    requests: OpenRequests
    shutdown: ShutdownGrace
    stall_s: float

    @classmethod
    def around(cls, engine: EngineClient, limits: ServeLimits) -> "Serving":
        snapshots = SnapshotKeeper(engine)
        requests = OpenRequests(on_idle=snapshots.refresh_soon)  # the idle state shows at once
        return cls(engine, ServerMetrics(), snapshots, requests,
                   ShutdownGrace(engine, requests, limits.shutdown_grace_s), limits.stall_s)

    def stalled_for(self) -> float | None:
        """Seconds the engine has had work without finishing a step, once past `stall_s`; else None."""
        busy = self.requests.busy_for()
        if busy is None:
            return None
        age = self.snapshots.step_age_s()
        stalled = busy if age is None else min(busy, age)
        return stalled if stalled > self.stall_s else None


class Generation:
    """One request inside the engine, seen from the event loop: its outputs in order, its latencies
    recorded, and an abort if the consumer stops before the end."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.engine = serving.engine
        self.latency = LatencyTracker(serving.metrics)
        self.request: Submitted | None = None
        self.finished = self.ended = False

    async def start(self, prompt, params, session: str | None) -> "Generation":
        try:
            self.request = await self.engine.submit(prompt, params, session)
        except ValueError as e:  # bad prompt, too long, ...
            raise api.from_value_error(e) from None
        except EngineGone as e:
            raise api.ApiError(503, f"the engine is not running: {e}", code="engine_unavailable",
                               kind="server_error") from None
        self.serving.requests.add(self.request.id)
        return self

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Its outputs until the finished one; each holds everything that arrived since the one before
        (a slow reader gets fewer, larger ones)."""
        feed = self.request.feed
        try:
            while not self.finished:
                out = await feed.next()
                self.latency.observe(out)
                self.finished = out.finished
                yield out
        finally:
            self.end()

    def end(self) -> None:
        """The request is no longer read: one not finished is aborted (its client left), which frees its
        blocks. Idempotent; a stream's background task calls it too, for a stream that never started."""
        if self.request is None or self.ended:
            return
        self.ended = True
        if not self.finished:
            self.engine.abort(self.request.id)
            self.serving.metrics.count_client_gone()
        self.serving.requests.remove(self.request.id)

    def failure(self, out: RequestOutput) -> api.ApiError:
        """What a request that ended with an error tells its client, counted as an error (and as ended
        by the shutdown when the grace ended it)."""
        if self.serving.shutdown.over:
            self.serving.metrics.count_shutdown_end()
            return api.ApiError(503, out.error or "the server is shutting down", code="shutting_down",
                                kind="server_error")
        return api.ApiError(500, out.error or "the request failed", code="engine_failed", kind="server_error")

    async def result(self, request: Request) -> RequestOutput | None:
        """The final output, or None if the client disconnected first (the request is then aborted)."""

        async def last() -> RequestOutput:
            async for out in self.outputs():
                pass
            return out

        answer = asyncio.ensure_future(last())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()
        try:
            await answer
        except asyncio.CancelledError:
            pass
        return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAiEndpoints:
    """/v1/chat/completions, /v1/completions and /v1/models, for one engine's model."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.engine, self.metrics = serving.engine, serving.metrics
        self.model = self.engine.config.model
        self.max_model_len = self.engine.max_model_len
        self.started = int(time.time())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models),
        ]

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, chat=False)

    async def models(self, request: Request) -> Response:
        card = {"id": self.model, "object": "model", "created": self.started, "owned_by": "zipage",
                "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def read_body(self, request: Request) -> dict:
        return api.read_request(await request.body(), self.model)

    async def complete(self, request: Request, chat: bool) -> Response:
        body = await self.read_body(request)
        prompt = api.chat_messages(body) if chat else api.completion_prompt(body)
        params = api.sampling_params(body, self.max_model_len)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise api.bad_request(f"stream={stream!r}: must be true or false", "stream")
        include_usage = api.stream_options(body)
        session = body.get("user") if isinstance(body.get("user"), str) else None
        generation = await Generation(self.serving).start(prompt, params, session)
        reply = api.Reply(chat, generation.request.id, self.model, generation.request.prompt_tokens,
                          token_ids=body.get("return_token_ids") is True)
        headers = {REQUEST_ID_HEADER: str(generation.request.id)}
        if stream:
            return self.streaming_response(generation, reply, include_usage, headers)
        return await self.whole_response(request, generation, reply, headers)

    def streaming_response(self, generation: Generation, reply: api.Reply, include_usage: bool,
                           headers: dict) -> Response:
        # Ending the request after the response is a no-op for a finished one (it catches a client gone
        # before the stream started).
        return StreamingResponse(stream_reply(generation, reply, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers}, background=BackgroundTask(generation.end))

    async def whole_response(self, request: Request, generation: Generation, reply: api.Reply,
                             headers: dict) -> Response:
        out = await generation.result(request)
        if out is None:
            return Response(status_code=499)  # nobody is listening any more
        if out.finish_reason == "error":
            raise generation.failure(out)
        return JSONResponse(reply.full(out), headers=headers)


async def stream_reply(generation: Generation, reply: api.Reply, include_usage: bool) -> AsyncIterator[str]:
    if reply.chat:
        yield sse(reply.chunk("", role=True))
    async for out in generation.outputs():
        # One chunk for everything that arrived since the last: a client (or an event loop) that
        # lags gets fewer, larger chunks instead of falling further behind.
        failed = out.finish_reason == "error"
        finished = out.finished and not failed
        events = []
        if out.delta or finished or (reply.token_ids and out.new_token_ids):
            events.append(sse(reply.chunk(out.delta, out.finish_reason if finished else None, out.new_token_ids)))
        if failed:
            error = generation.failure(out)
            generation.serving.metrics.count_error(error_reason(error))
            events.append(sse(error.body()))
        elif finished and include_usage:
            events.append(sse(reply.usage_chunk(out.num_output_tokens)))
        if events:
            yield "".join(events)
    yield sse("[DONE]")


class ObservationEndpoints:
    """/health, /metrics and what the console panes draw: /zipage/snapshot, /zipage/config, /zipage/events."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.engine, self.metrics = serving.engine, serving.metrics

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health),
            Route("/metrics", self.prometheus),
            Route("/zipage/snapshot", self.snapshot),
            Route("/zipage/config", self.config),
            Route("/zipage/events", self.events),
        ]

    async def health(self, request: Request) -> Response:
        """200 while the engine runs and steps; 503 with the reason once it stopped, or while requests
        wait and no step has finished for `stall_s`. Never waits on the engine."""
        problem = self.engine_problem()
        if problem is not None:
            raise problem
        return JSONResponse({"status": "ok"})

    def engine_problem(self) -> api.ApiError | None:
        if not self.engine.alive:
            return api.ApiError(503, f"the engine stopped: {self.engine.failure or self.engine.process.exit_reason}",
                                code="engine_stopped", kind="server_error")
        stalled = self.serving.stalled_for()
        if stalled is not None:
            waiting = len(self.serving.requests.ids)
            return api.ApiError(503, f"the engine is stalled: {waiting} request(s) open and no engine step "
                                     f"finished for {stalled:.0f} s", code="engine_stalled", kind="server_error")
        return None

    async def prometheus(self, request: Request) -> Response:
        # The last snapshot known, never one asked for now: a scrape must answer while the engine is stuck.
        snapshots = self.serving.snapshots
        body = self.metrics.render(snapshots.latest, self.engine.alive, snapshots.step_age_s())
        return Response(body, media_type=CONTENT_TYPE)

    async def snapshot(self, request: Request) -> Response:
        """A recent snapshot (at most a quarter of a second old); `?fresh=1` waits for one taken now."""
        snap = await self.engine.snapshot(fresh=request.query_params.get("fresh") in ("1", "true"))
        self.serving.snapshots.adopt(snap)
        return JSONResponse(snapshot_to_dict(snap))

    async def config(self, request: Request) -> Response:
        return JSONResponse(asdict(self.engine.config))

    async def events(self, request: Request) -> Response:
        return StreamingResponse(event_stream(self.engine, self.serving.shutdown), media_type="text/event-stream",
                                 headers=SSE_HEADERS)


async def event_stream(engine: EngineClient, shutdown: ShutdownGrace) -> AsyncIterator[str]:
    """Every engine event as it comes, until the client leaves or the shutdown's grace ends."""
    inbox = engine.subscribe()
    try:
        quiet_since = time.monotonic()
        yield ": events follow\n\n"
        while not shutdown.over:
            await asyncio.sleep(EVENT_POLL_S)
            batch = []
            while not inbox.empty():
                batch.append(inbox.get_nowait())
            for event in batch:
                yield sse(event_to_dict(event))
            if batch:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
    finally:
        engine.unsubscribe(inbox)


def metrics_of(request: Request) -> ServerMetrics:
    return request.app.state.serving.metrics


async def on_api_error(request: Request, e: api.ApiError) -> Response:
    return refuse(e, metrics_of(request))


async def on_http_error(request: Request, e: HTTPException) -> Response:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return refuse(api.ApiError(e.status_code, f"{request.url.path}: {e.detail}", kind=kind), metrics_of(request))


async def on_crash(request: Request, e: Exception) -> Response:
    error = api.ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
    return refuse(error, metrics_of(request))


# Every failure answers in the OpenAI error shape, a crash included.
EXCEPTION_HANDLERS = {api.ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash}


def engine_lifespan(serving: Serving):
    """The engine's turns are read on the server's event loop: it starts with the loop and closes with it,
    and so does the task that keeps its snapshot recent."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        serving.engine.start()
        keeper = asyncio.ensure_future(serving.snapshots.run())
        try:
            yield
        finally:
            serving.shutdown.cancel()
            serving.engine.close()
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    return lifespan


def middleware(serving: Serving, api_key: str | None, limits: ServeLimits) -> list[Middleware]:
    """Outermost first: CORS answers a browser's preflight, which carries no key; the key is checked
    before a body is looked at."""
    stack = []
    if limits.allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                                allow_methods=["GET", "POST"], allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER]))
    if api_key:
        stack.append(Middleware(ApiKeyGuard, api_key=api_key, metrics=serving.metrics))
    stack.append(Middleware(RequestLimits, max_body_bytes=limits.max_body_bytes, metrics=serving.metrics))
    return stack


def create_app(engine: EngineClient, api_key: str | None = None, limits: ServeLimits = ServeLimits()) -> Starlette:
    """The HTTP app in front of `engine`; with `api_key`, every path but /health asks for it."""
    serving = Serving.around(engine, limits)
    routes = OpenAiEndpoints(serving).routes() + ObservationEndpoints(serving).routes()
    app = Starlette(routes=routes, middleware=middleware(serving, api_key, limits),
                    exception_handlers=EXCEPTION_HANDLERS, lifespan=engine_lifespan(serving))
    app.state.serving = serving
    return app


def serve(engine: EngineProcess, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info", limits: ServeLimits = ServeLimits()) -> None:
    """Run the server in this thread until interrupted; the caller closes the engine afterwards."""
    import uvicorn

    app = create_app(EngineClient(engine), api_key, limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **connection_settings(limits))
    # uvicorn raises SIGTERM again once it has shut down; raised as SystemExit instead of killing this
    # process outright, it leaves the caller the time to stop the engine process.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main_thread else None
    try:
        graceful_server(config, app.state.serving.shutdown).run()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def connection_settings(limits: ServeLimits) -> dict:
    """uvicorn's settings for slow, idle or too many clients, and its last-resort shutdown deadline."""
    return dict(
        http=h11_with_head_deadline(), timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        # uvicorn counts the connection asking too: one more lets `max_connections` connections be served.
        limit_concurrency=None if limits.max_connections is None else limits.max_connections + 1,
        # ShutdownGrace ends open streams at the grace; uvicorn cancels whatever is left past this.
        timeout_graceful_shutdown=limits.shutdown_grace_s + SHUTDOWN_BACKSTOP_S)


def graceful_server(config, grace: ShutdownGrace):
    """A uvicorn Server that starts the grace of open streams as it stops accepting connections."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            grace.begin()
            await super().shutdown(sockets)

    return GracefulServer(config)


def h11_with_head_deadline():
    """uvicorn's h11 protocol, its keep-alive timer also bounding the wait for a request's head: a
    connection that opens, or finishes a response, and has not sent a whole head within the keep-alive
    timeout is closed. (uvicorn stops that timer at the first byte, so a client sending its head a byte
    at a time would hold the connection for ever.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithHeadDeadline(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            self.conn.receive_data(data)
            self.handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived: its deadline is met
                self._unset_keepalive_if_required()

    return H11WithHeadDeadline


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)
