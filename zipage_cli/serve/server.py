"""`zipage serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) in front of an engine process.

The engine runs in a child process (engine/api/process.py); this process holds HTTP, tokenizing and
detokenizing, and its event loop receives every request's new tokens once per engine step
(engine_client.py). Each prompt of a call is an engine request of its own, and the call is served or
ended as a whole: a client that goes away aborts all its requests, which frees their blocks.
`/zipage/snapshot`, `/zipage/config`, `/zipage/events` and `/zipage/requests/{id}/kept` carry what the
console panes draw, for `zipage top|chat --attach`. What a client may send or hold (body size, content
type, CORS origins, timeouts, connections), the graceful shutdown and the health rules are
`ServeLimits`, described in docs/serving.md.

This module is the app and its routes. The guards in front of it and `ServeLimits` are guards.py, what
the endpoints share while the server runs is serving.py, and running it on uvicorn (`serve`) is
lifecycle.py.
"""

import asyncio
import contextlib
import json
import time
from dataclasses import asdict
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zipage.engine.core.outputs import RequestOutput, UnknownRequest
from zipage.engine.events import event_to_dict, snapshot_to_dict
from zipage.engine.api.process import EngineGone
from zipage.cli.serve import openai_protocol as api
from zipage.cli.serve.engine_client import EngineClient, SubmittedTogether
from zipage.cli.serve.guards import ApiKeyGuard, RequestLimits, ServeLimits, error_reason, refuse
from zipage.cli.serve.logprobs import LogprobReply, TokenTexts
from zipage.cli.serve.metrics import CONTENT_TYPE, LatencyTracker, ServerMetrics
from zipage.cli.serve.serving import Serving, ShutdownGrace, engine_lifespan
from zipage.cli.serve.tool_calls import ToolStream, tool_plan

EVENT_POLL_S = 0.1  # how often /zipage/events forwards new engine events
KEEPALIVE_S = 2.0  # an idle event stream sends a comment this often, so either side notices a dead peer
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REQUEST_ID_HEADER = "x-zipage-request-id"  # the engine's id of the request, as the console panes show it


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Generation:
    """The engine requests of one API call, one per prompt, seen from the event loop: their outputs as
    they come, their latencies recorded, and the call served or ended as a whole: when the consumer
    stops before the end (its client left, or one prompt failed), every request not finished is aborted."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.engine = serving.engine
        self.batch: SubmittedTogether | None = None
        self.latencies: list[LatencyTracker] = []
        self.unfinished: set[int] = set()  # the prompts whose final output has not come
        self.failed = self.ended = False

    async def start(self, prompts: list, params, session: str | None) -> "Generation":
        try:
            self.batch = await self.engine.submit_all(prompts, params, session)
        except ValueError as e:  # bad prompt, too long, ...
            raise api.from_value_error(e) from None
        except EngineGone as e:
            raise api.ApiError(503, f"the engine is not running: {e}", code="engine_unavailable",
                               kind="server_error") from None
        self.latencies = [LatencyTracker(self.serving.metrics) for _ in self.batch.requests]
        self.unfinished = set(range(len(self.batch.requests)))
        for request_id in self.ids:
            self.serving.requests.add(request_id)
        return self

    @property
    def ids(self) -> list[int]:
        """The engine's ids of its requests, in prompt order."""
        return [request.id for request in self.batch.requests]

    @property
    def prompt_tokens(self) -> int:
        return sum(request.prompt_tokens for request in self.batch.requests)

    async def outputs(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """What arrived, as (prompt index, output) pairs, until every prompt's final output; each output
        holds everything of its prompt since the one before (a slow reader gets fewer, larger ones)."""
        try:
            while self.unfinished:
                news = await self.batch.next()
                for index, out in news:
                    self.latencies[index].observe(out)
                    if out.finished:
                        self.unfinished.discard(index)
                    if out.finish_reason == "error":
                        self.failed = True
                        if self.serving.shutdown.over:
                            self.serving.metrics.count_shutdown_end()
                yield news
        finally:
            self.end()

    def end(self) -> None:
        """The requests are no longer read: those not finished are aborted, which frees their blocks.
        Idempotent; a stream's background task calls it too, for a stream that never started."""
        if self.batch is None or self.ended:
            return
        self.ended = True
        for index, request_id in enumerate(self.ids):
            if index in self.unfinished:
                self.engine.abort(request_id)
                if self.failed:  # another prompt of the call failed
                    self.serving.metrics.count_dropped()
                else:
                    self.serving.metrics.count_client_gone()
            self.serving.requests.remove(request_id)

    def failure(self, out: RequestOutput) -> api.ApiError:
        """What a call whose request ended with an error tells its client: 503 when the shutdown's grace
        ended it."""
        if self.serving.shutdown.over:
            return api.ApiError(503, out.error or "the server is shutting down", code="shutting_down",
                                kind="server_error")
        return api.ApiError(500, out.error or "the request failed", code="engine_failed", kind="server_error")

    async def result(self, request: Request) -> list[RequestOutput] | None:
        """Every prompt's final output, in prompt order, or None if the client disconnected first (the
        requests are then aborted). The ApiError of the first that failed, the others aborted."""

        async def finals() -> list[RequestOutput]:
            done = {}
            async with contextlib.aclosing(self.outputs()) as outputs:
                async for news in outputs:
                    for index, out in news:
                        if out.finish_reason == "error":
                            raise self.failure(out)
                        if out.finished:
                            done[index] = out
            return [done[index] for index in range(len(done))]

        answer = asyncio.ensure_future(finals())
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
        self.texts = TokenTexts(self.engine.process.tokenizer)  # each token's text, for logprobs

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
        tools = tool_plan(body, self.engine.process.prompts.template_takes_tools) if chat else None
        prompts = [api.chat_messages(body, tools and tools.tools)] if chat else api.completion_prompts(body)
        params = api.sampling_params(body, self.max_model_len, chat, tools and tools.schema)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise api.bad_request(f"stream={stream!r}: must be true or false", "stream")
        include_usage = api.stream_options(body)
        session = body.get("user") if isinstance(body.get("user"), str) else None
        generation = await Generation(self.serving).start(prompts, params, session)
        reply = api.Reply(chat, generation.ids[0], self.model, generation.prompt_tokens,
                          token_ids=body.get("return_token_ids") is True,
                          logprobs=self.logprob_reply(chat, body.get("echo") is True, params, prompts, generation),
                          tools=tools)
        headers = {REQUEST_ID_HEADER: ",".join(map(str, generation.ids))}  # one id per prompt
        if stream:
            return self.streaming_response(generation, reply, include_usage, headers)
        return await self.whole_response(request, generation, reply, headers)

    def logprob_reply(self, chat: bool, echo: bool, params, prompts: list, generation: Generation
                      ) -> LogprobReply | None:
        """What logprobs and echo add to each choice (docs/serving.md, "Log-probabilities"); None if nothing."""
        if params.logprobs is None and not echo:
            return None
        prompt_ids = [request.prompt_ids for request in generation.batch.requests]
        decode = self.texts.tokenizer.decode
        texts = [prompt if isinstance(prompt, str) else decode(ids, skip_special_tokens=False)
                 for prompt, ids in zip(prompts, prompt_ids)] if echo else None
        return LogprobReply(chat, self.texts, params.logprobs is not None, texts, prompt_ids)

    def streaming_response(self, generation: Generation, reply: api.Reply, include_usage: bool,
                           headers: dict) -> Response:
        # Ending the request after the response is a no-op for a finished one (it catches a client gone
        # before the stream started).
        return StreamingResponse(stream_reply(generation, reply, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers}, background=BackgroundTask(generation.end))

    async def whole_response(self, request: Request, generation: Generation, reply: api.Reply,
                             headers: dict) -> Response:
        outs = await generation.result(request)
        if outs is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(reply.full(outs), headers=headers)


async def stream_reply(generation: Generation, reply: api.Reply, include_usage: bool) -> AsyncIterator[str]:
    """The chunks of every prompt as they come, each with its prompt's index; one usage chunk at the end.
    A request that fails ends the stream with an error event (the other prompts' requests are aborted)."""
    if reply.chat:
        yield sse(reply.chunk("", role=True))
    held = ToolStream(reply.tools) if reply.tools else None  # tools come with a chat: one prompt
    completion_tokens, ended, error = 0, [], None
    async with contextlib.aclosing(generation.outputs()) as outputs:
        async for news in outputs:
            # One chunk per prompt for everything that arrived since the last: a client (or an event
            # loop) that lags gets fewer, larger chunks instead of falling further behind.
            events = []
            for index, out in news:
                failed = out.finish_reason == "error"
                finished = out.finished and not failed
                echo, logprobs = reply.logprobs.streamed(index, out) if reply.logprobs else ("", None)
                text, calls = echo + out.delta, []
                if held is not None:  # what may be a tool call waits for the end
                    text = held.feed(out.delta)
                    if finished:
                        rest, calls = held.finish(out.finish_reason)
                        text += rest
                if text or finished or logprobs or (reply.token_ids and out.new_token_ids):
                    events.append(sse(reply.chunk(text, out.finish_reason if finished else None,
                                                  out.new_token_ids, index=index, logprobs=logprobs,
                                                  new_logprobs=out.new_logprobs, tool_calls=calls)))
                if finished:
                    completion_tokens += out.num_output_tokens
                    ended.append(out)
                if failed and error is None:
                    error = generation.failure(out)
            if error is not None:
                generation.serving.metrics.count_error(error_reason(error))
                events.append(sse(error.body()))
            if events:
                yield "".join(events)
            if error is not None:
                break
    if include_usage and error is None:
        yield sse(reply.usage_chunk(completion_tokens, ended))
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


async def on_client_gone(request: Request, e: ClientDisconnect) -> Response:
    return Response(status_code=499)  # the client left before its body was read: nobody is listening


async def on_crash(request: Request, e: Exception) -> Response:
    error = api.ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
    return refuse(error, metrics_of(request))


# Every failure answers in the OpenAI error shape, a crash included; a client that left before its body
# was read gets a bare 499, which nobody reads.
EXCEPTION_HANDLERS = {api.ApiError: on_api_error, HTTPException: on_http_error, ClientDisconnect: on_client_gone,
                      Exception: on_crash}


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
