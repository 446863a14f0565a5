"""`zipage serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) in front of an engine process.

The engine runs in a child process (engine/api/process.py); this process holds HTTP, tokenizing and
detokenizing, and its event loop receives every request's new tokens once per engine step
(engine_client.py). A client that goes away aborts its request, which frees its blocks.
`/zipage/snapshot`, `/zipage/config`, `/zipage/events` and `/zipage/requests/{id}/kept` carry what the
console panes draw, for `zipage top|chat --attach`. What a client may send or hold (body size, content
type, CORS origins, timeouts, connections), the graceful shutdown and the health rules are
`ServeLimits`, described in docs/serving.md.

This module is the app and its routes. The guards in front of it and `ServeLimits` are guards.py, what
the endpoints share while the server runs is serving.py, and running it on uvicorn (`serve`) is
lifecycle.py.
"""

import asyncio
import json
import time
from dataclasses import asdict
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zipage.engine.core.outputs import RequestOutput, UnknownRequest
from zipage.engine.events import event_to_dict, snapshot_to_dict
from zipage.engine.api.process import EngineGone
from zipage.cli.serve import openai_protocol as api
from zipage.cli.serve.engine_client import EngineClient, Submitted
from zipage.cli.serve.guards import ApiKeyGuard, RequestLimits, ServeLimits, error_reason, refuse
from zipage.cli.serve.metrics import CONTENT_TYPE, LatencyTracker, ServerMetrics
from zipage.cli.serve.serving import Serving, ShutdownGrace, engine_lifespan

EVENT_POLL_S = 0.1  # how often /zipage/events forwards new engine events
KEEPALIVE_S = 2.0  # an idle event stream sends a comment this often, so either side notices a dead peer
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "x-zipage-request-id"  # the engine's id of the request, as the console panes show it


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


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
    """/health, /metrics and what the console panes draw: /zipage/snapshot, /zipage/config, /zipage/events,
    and which positions a request's KV cache still holds: /zipage/requests/{id}/kept."""

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
            Route("/zipage/requests/{request_id:int}/kept", self.kept),
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

    async def kept(self, request: Request) -> Response:
        """KeptMap.to_dict() of a running request, by the engine's id (the snapshot's and the
        x-zipage-request-id header's); 404 for one the engine does not hold (docs/serving.md)."""
        request_id = request.path_params["request_id"]
        try:
            kept = await self.engine.kept(request_id)
        except UnknownRequest as e:
            raise api.ApiError(404, str(e), code="request_not_found") from None
        except EngineGone as e:
            raise api.ApiError(503, f"the engine is not running: {e}", code="engine_unavailable",
                               kind="server_error") from None
        return JSONResponse(kept.to_dict())

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
