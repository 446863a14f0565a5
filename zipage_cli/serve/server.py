"""`zipage serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) in front of an engine process.

The engine runs in a child process (engine/api/process.py); this process holds HTTP, tokenizing and
detokenizing, and its event loop receives every request's new tokens once per engine step
(engine_client.py). A client that goes away aborts its request, which frees its blocks.
`/zipage/snapshot`, `/zipage/config` and `/zipage/events` carry what the console panes draw, for
`zipage top|chat --attach`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
import time
from dataclasses import asdict
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zipage.engine.core.outputs import RequestOutput
from zipage.engine.events import event_to_dict, snapshot_to_dict
from zipage.engine.api.process import EngineGone, EngineProcess
from zipage.cli.serve import openai_protocol as api
from zipage.cli.serve.engine_client import EngineClient, Submitted
from zipage.cli.serve.metrics import CONTENT_TYPE, LatencyTracker, ServerMetrics

OPEN_PATHS = ("/health",)  # reachable without the API key
EVENT_POLL_S = 0.1  # how often /zipage/events forwards new engine events
KEEPALIVE_S = 2.0  # an idle event stream sends a comment this often, so either side notices a dead peer
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "x-zipage-request-id"  # the engine's id of the request, as the console panes show it


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_response(e: api.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class ApiKeyGuard:
    """ASGI middleware: every path but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = api.ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                     code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Generation:
    """One request inside the engine, seen from the event loop: its outputs in order, its latencies
    recorded, and an abort if the consumer stops before the end."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics):
        self.engine = engine
        self.latency = LatencyTracker(metrics)
        self.request: Submitted | None = None
        self.finished = False

    async def start(self, prompt, params, session: str | None) -> "Generation":
        try:
            self.request = await self.engine.submit(prompt, params, session)
        except ValueError as e:  # bad prompt, too long, ...
            raise api.from_value_error(e) from None
        except EngineGone as e:
            raise api.ApiError(503, f"the engine is not running: {e}", kind="server_error") from None
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
            if not self.finished:  # the client left (or the server stops): free the request's blocks
                self.engine.abort(self.request.id)

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

    def __init__(self, engine: EngineClient, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics
        self.model = engine.config.model
        self.max_model_len = engine.max_model_len
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
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise api.bad_request("the request body must be a JSON object")
        api.check_model(body, self.model)
        return body

    async def complete(self, request: Request, chat: bool) -> Response:
        body = await self.read_body(request)
        prompt = api.chat_messages(body) if chat else api.completion_prompt(body)
        params = api.sampling_params(body, self.max_model_len)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise api.bad_request(f"stream={stream!r}: must be true or false", "stream")
        include_usage = api.stream_options(body)
        session = body.get("user") if isinstance(body.get("user"), str) else None
        generation = await Generation(self.engine, self.metrics).start(prompt, params, session)
        reply = api.Reply(chat, generation.request.id, self.model, generation.request.prompt_tokens,
                          token_ids=body.get("return_token_ids") is True)
        headers = {REQUEST_ID_HEADER: str(generation.request.id)}
        if stream:
            return self.streaming_response(generation, reply, include_usage, headers)
        return await self.whole_response(request, generation, reply, headers)

    def streaming_response(self, generation: Generation, reply: api.Reply, include_usage: bool,
                           headers: dict) -> Response:
        # The abort after the response is a no-op for a finished request (it catches a client gone early).
        return StreamingResponse(stream_reply(generation, reply, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers},
                                 background=BackgroundTask(self.engine.abort, generation.request.id))

    async def whole_response(self, request: Request, generation: Generation, reply: api.Reply,
                             headers: dict) -> Response:
        out = await generation.result(request)
        if out is None:
            return Response(status_code=499)  # nobody is listening any more
        if out.finish_reason == "error":
            raise api.ApiError(500, out.error or "the request failed", kind="server_error")
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
            events.append(sse(api.error_body(out.error or "the request failed", "server_error")))
        elif finished and include_usage:
            events.append(sse(reply.usage_chunk(out.num_output_tokens)))
        if events:
            yield "".join(events)
    yield sse("[DONE]")


class ObservationEndpoints:
    """/health, /metrics and what the console panes draw: /zipage/snapshot, /zipage/config, /zipage/events."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health),
            Route("/metrics", self.prometheus),
            Route("/zipage/snapshot", self.snapshot),
            Route("/zipage/config", self.config),
            Route("/zipage/events", self.events),
        ]

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            raise api.ApiError(503, f"the engine stopped: {self.engine.failure or self.engine.process.exit_reason}",
                               kind="server_error")
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        # A scrape waits for a snapshot taken now (at most one engine step), so counters are current.
        snap = await self.engine.snapshot(fresh=True)
        return Response(self.metrics.render(snap), media_type=CONTENT_TYPE)

    async def snapshot(self, request: Request) -> Response:
        """The latest published snapshot (a few times a second); `?fresh=1` waits for one taken now."""
        snap = await self.engine.snapshot(fresh=request.query_params.get("fresh") in ("1", "true"))
        return JSONResponse(snapshot_to_dict(snap))

    async def config(self, request: Request) -> Response:
        return JSONResponse(asdict(self.engine.config))

    async def events(self, request: Request) -> Response:
        return StreamingResponse(event_stream(self.engine), media_type="text/event-stream", headers=SSE_HEADERS)


async def event_stream(engine: EngineClient) -> AsyncIterator[str]:
    inbox = engine.subscribe()
    try:
        quiet_since = time.monotonic()
        yield ": events follow\n\n"
        while True:
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


async def on_api_error(request: Request, e: api.ApiError) -> Response:
    return error_response(e)


async def on_http_error(request: Request, e: HTTPException) -> Response:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return error_response(api.ApiError(e.status_code, f"{request.url.path}: {e.detail}", kind=kind))


async def on_crash(request: Request, e: Exception) -> Response:
    return error_response(api.ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))


# Every failure answers in the OpenAI error shape, a crash included.
EXCEPTION_HANDLERS = {api.ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash}


def engine_lifespan(engine: EngineClient):
    """The engine's turns are read on the server's event loop: it starts with the loop and closes with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.close()

    return lifespan


def create_app(engine: EngineClient, api_key: str | None = None) -> Starlette:
    """The HTTP app in front of `engine`; with `api_key`, every path but /health asks for it."""
    metrics = ServerMetrics()
    routes = OpenAiEndpoints(engine, metrics).routes() + ObservationEndpoints(engine, metrics).routes()
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=engine_lifespan(engine))
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    return app


def serve(engine: EngineProcess, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info") -> None:
    """Run the server in this thread until interrupted; the caller closes the engine afterwards."""
    import uvicorn

    config = uvicorn.Config(create_app(EngineClient(engine), api_key), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=3)
    # uvicorn raises SIGTERM again once it has shut down; raised as SystemExit instead of killing this
    # process outright, it leaves the caller the time to stop the engine process.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main_thread else None
    try:
        uvicorn.Server(config).run()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)
