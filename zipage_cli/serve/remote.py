"""A running `zipage serve` as a FrontDoor (engine/api/protocol.py): the console holds it exactly as
it holds a local EngineThread.

One background thread runs an asyncio loop with an httpx client: it polls /zipage/snapshot, follows
/zipage/events, and streams answers from /v1/chat/completions or /v1/completions. Aborting a request
closes its stream; the server sees the disconnect and frees the request's blocks. Teaching mode
(pause and single steps) needs the engine in this process, so it is refused here.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import fields
from typing import Callable

import httpx

from zipage.engine.config import EngineConfig, SamplingParams
from zipage.engine.core.outputs import PromptTooLong, RequestOutput, UnknownRequest
from zipage.engine.events import EngineSnapshot, event_from_dict, snapshot_from_dict
from zipage.engine.api.handles import SUBSCRIBER_QUEUE_SIZE, EventQueue, RequestHandle, Subscribers
from zipage.engine.kv.kept import KeptMap
from zipage.engine.loading.grammars import schema_of
from zipage.engine.logprobs import TokenLogprobs
from zipage.cli.serve.logprobs import texts_by_id
from zipage.cli.serve.openai_protocol import CONTEXT_LENGTH_EXCEEDED
from zipage.cli.serve.server import REQUEST_ID_HEADER

POLL_S = 0.25  # snapshot refresh, the rate EngineThread publishes at
CONNECT_TIMEOUT_S = 10.0
EVENTS_READ_TIMEOUT_S = 15.0  # the server sends a keepalive every few seconds
RETRY_S = 1.0
# The server answers a request's headers once its engine has taken it, which takes a step at most;
# a server that has not by then is hung (or stopped), and the request must not wait for ever.
ACCEPT_TIMEOUT_S = 60.0


class RemoteHandle(RequestHandle):
    """A request streamed from the server; iterating yields text deltas, as with a local handle."""

    task: asyncio.Task | None = None
    # As a local answer's: arrival (the submit) and first token on this machine's monotonic clock; the
    # prompt tokens the server's prefix cache served and the KV compressions, from the usage chunk.
    metrics: dict


def response_format_of(json_schema) -> dict:
    """The OpenAI response_format that asks a server for what SamplingParams.json_schema asks."""
    if json_schema is True:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema_of(json_schema)}}


class RemoteEngine:
    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = None  # tokenization happens on the server
        # Each token's text as the server's logprobs spell it (the token decoded alone), learned from the
        # answers that asked for logprobs: the console's texts for ids, without a tokenizer here.
        self.token_texts: dict[int, str] = {}
        self.failure: BaseException | None = None
        self._poll_error: str | None = None  # why the snapshot is not current, None while it is
        self._events_error: str | None = None
        self.config, self._snapshot = self._connect(api_key is not None)
        self._subscribers = Subscribers()
        self._handles: set[RemoteHandle] = set()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zipage-remote", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._open_client())
        self._background = [self._call(self._spawn(self._poll_snapshots())),
                            self._call(self._spawn(self._follow_events()))]

    def _connect(self, keyed: bool) -> tuple[EngineConfig, EngineSnapshot]:
        """The server's config and snapshot; every problem becomes a ValueError that says what to fix."""
        try:
            with httpx.Client(base_url=self.url, headers=self.headers, timeout=CONNECT_TIMEOUT_S) as client:
                config = self._get(client, "/zipage/config", keyed)
                snapshot = self._get(client, "/zipage/snapshot", keyed)
        except httpx.InvalidURL as e:  # not an httpx.HTTPError: raised before any request is sent
            raise ValueError(f"{self.url} is not a valid URL: {_describe(e)}") from None
        try:
            known = {f.name for f in fields(EngineConfig)}
            return EngineConfig(**{k: v for k, v in config.items() if k in known}), snapshot_from_dict(snapshot)
        except (AttributeError, KeyError, TypeError, ValueError):  # some other server's JSON
            raise ValueError(f"{self.url} answered, but not as a zipage server does: is it `zipage serve`?") from None

    def _get(self, client: httpx.Client, path: str, keyed: bool):
        try:
            response = client.get(path)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach a zipage server at {self.url}: {_describe(e)}") from None
        if response.status_code == 401 and keyed:
            raise ValueError(f"{self.url} refused the API key: check --api-key (or ZIPAGE_API_KEY)")
        if response.status_code == 401:
            raise ValueError(f"{self.url} wants an API key: pass --api-key (or set ZIPAGE_API_KEY)")
        if response.status_code != 200:
            raise ValueError(f"{self.url}{path} answered {response.status_code}: is it a zipage server?")
        try:
            return response.json()
        except ValueError:
            raise ValueError(f"{self.url}{path} did not answer JSON: is it a zipage server?") from None

    # -- the loop thread -------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        """Run a coroutine on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open_client(self) -> httpx.AsyncClient:
        # No read timeout: an answer may wait in the server's queue for a long time.
        return httpx.AsyncClient(base_url=self.url, headers=self.headers,
                                 timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None))

    async def _spawn(self, coro) -> asyncio.Task:
        return asyncio.create_task(coro)

    @property
    def error(self) -> str | None:
        """Why the snapshot and events are not current (the server is gone, or its engine stopped);
        None while they are."""
        return self._poll_error or self._events_error

    async def _poll_snapshots(self) -> None:
        while True:
            self._poll_error = await self._poll_once()
            await asyncio.sleep(POLL_S)

    async def _poll_once(self) -> str | None:
        """Refresh the snapshot; returns what keeps it from being current, or None."""
        try:
            response = await self._client.get("/zipage/snapshot", timeout=CONNECT_TIMEOUT_S)
            response.raise_for_status()
            self._snapshot = snapshot_from_dict(response.json())
            # A server whose engine died still serves that engine's last snapshot: only /health tells.
            health = await self._client.get("/health", timeout=CONNECT_TIMEOUT_S)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            return f"lost the server at {self.url}: {_describe(e)}"
        if health.status_code != 200:
            return f"the server at {self.url} answers, but {_error_message(health)}"
        return None

    async def _follow_events(self) -> None:
        while True:
            try:
                async with self._client.stream("GET", "/zipage/events",
                                               timeout=httpx.Timeout(CONNECT_TIMEOUT_S,
                                                                     read=EVENTS_READ_TIMEOUT_S)) as response:
                    response.raise_for_status()
                    self._events_error = None
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            self._subscribers.publish([event_from_dict(json.loads(line[6:]))])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self._events_error = f"lost the event stream of {self.url}: {_describe(e)}"
            await asyncio.sleep(RETRY_S)

    # -- the FrontDoor protocol ------------------------------------------------------
    def snapshot(self, fresh: bool = False) -> EngineSnapshot:
        if fresh:
            async def fetch():
                response = await self._client.get("/zipage/snapshot", params={"fresh": 1},
                                                   timeout=CONNECT_TIMEOUT_S)
                response.raise_for_status()
                return snapshot_from_dict(response.json())

            self._snapshot = self._call(fetch())
        return self._snapshot

    def kept(self, handle: RemoteHandle | int) -> KeptMap:
        """What a running request's KV cache still holds, and why, from /zipage/requests/{id}/kept.
        UnknownRequest when the server answers 404 (a request its engine does not hold)."""
        request_id = handle.id if isinstance(handle, RequestHandle) else int(handle)

        async def fetch() -> httpx.Response:
            return await self._client.get(f"/zipage/requests/{request_id}/kept", timeout=CONNECT_TIMEOUT_S)

        try:
            response = self._call(fetch())
        except httpx.HTTPError as e:
            raise RuntimeError(f"cannot reach the server at {self.url}: {_describe(e)}") from None
        if response.status_code == 404:
            raise UnknownRequest(_error_message(response))
        if response.status_code != 200:
            raise RuntimeError(f"{self.url} answered {response.status_code} for request {request_id}'s kept "
                               f"positions: {_error_message(response)}")
        return KeptMap.from_dict(response.json())

    def subscribe(self, maxsize: int = SUBSCRIBER_QUEUE_SIZE) -> EventQueue:
        return self._subscribers.subscribe(maxsize)

    def unsubscribe(self, q: EventQueue) -> None:
        self._subscribers.unsubscribe(q)

    def submit(self, prompt, params: SamplingParams | None = None, *, session: str | None = None,
               on_output: Callable[[RequestOutput], None] | None = None) -> RemoteHandle:
        """Chat messages go to /v1/chat/completions, text or token ids to /v1/completions. The server's
        refusal (bad values, prompt too long) raises ValueError here, as a local engine would. Logprobs
        come back as the engine's TokenLogprobs (the server's `logprobs_by_id`); `on_output` runs on
        this door's loop thread."""
        params = params or SamplingParams()
        params.validate()
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available through an attached server (its chat and "
                             "completions answers carry the answer's logprobs only)")
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        body = {"model": self.config.model, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "user": session, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
                "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
                "max_tokens": params.max_tokens, "seed": params.seed, "stop": params.stop or None,
                "ignore_eos": params.ignore_eos, "kv_budget": params.kv_budget,
                ("messages" if chat else "prompt"): prompt}
        if params.logprobs is not None:
            body.update({"logprobs": True, "top_logprobs": params.logprobs} if chat
                        else {"logprobs": params.logprobs})
        if params.json_schema is not None:
            body["response_format"] = response_format_of(params.json_schema)
        handle = self._call(self._start(f"/v1/{'chat/' if chat else ''}completions", body, session, on_output))
        with self._lock:
            self._handles.add(handle)
        return handle

    async def _start(self, path: str, body: dict, session: str | None, on_output=None) -> RemoteHandle:
        arrival = time.monotonic()
        try:
            response = await asyncio.wait_for(
                self._client.send(self._client.build_request("POST", path, json=body), stream=True), ACCEPT_TIMEOUT_S)
        except asyncio.TimeoutError:  # the connection is closed, so a server that wakes up drops the request
            raise RuntimeError(f"the server at {self.url} did not take the request within {ACCEPT_TIMEOUT_S:g} s: "
                               "is it hung?") from None
        except httpx.HTTPError as e:
            raise RuntimeError(f"cannot reach the server at {self.url}: {_describe(e)}") from None
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            raise _refusal(response)
        handle = RemoteHandle(int(response.headers.get(REQUEST_ID_HEADER, -1)), session, 0, on_output)
        handle.metrics = {"arrival": arrival}
        logprobs = [] if "logprobs" in body else None
        handle.task = asyncio.create_task(self._read(response, handle, logprobs))
        return handle

    async def _read(self, response: httpx.Response, handle: RemoteHandle, logprobs: list | None) -> None:
        """Each chunk's text, ids and logprobs as one output; the final output holds them all."""
        text, token_ids, reason, error = "", [], None, None
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    reason, error = "error", chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    handle.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    handle.metrics.update(prompt_tokens=handle.prompt_tokens, cached_prompt_tokens=(
                        chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                        times_compressed=chunk["usage"].get("kv_compressions", 0))
                for choice in chunk["choices"]:
                    delta = (choice["delta"].get("content") or "") if "delta" in choice else choice.get("text", "")
                    new_ids = choice.get("token_ids") or []
                    token_ids += new_ids
                    new_logprobs = None if logprobs is None else self._logprobs_of(choice)
                    if new_logprobs:
                        logprobs += new_logprobs
                    reason = choice.get("finish_reason") or reason
                    if delta or new_ids:
                        handle.metrics.setdefault("first_token", time.monotonic())
                        text += delta
                        handle._push(RequestOutput(handle.id, handle.session, [], [], text, delta, False,
                                                   new_token_ids=new_ids, num_output_tokens=len(token_ids),
                                                   new_logprobs=new_logprobs))
        except asyncio.CancelledError:
            reason = "abort"  # abort(): closing the stream below tells the server to stop
        except (httpx.HTTPError, ValueError, KeyError) as e:
            reason, error = "error", f"the stream from {self.url} broke: {_describe(e)}"
        finally:
            await response.aclose()
            if reason is None:
                reason, error = "error", "the server ended the stream without a finish reason"
            handle._push(RequestOutput(handle.id, handle.session, [], token_ids, text, "", True, reason, error,
                                       handle.metrics, num_output_tokens=len(token_ids), logprobs=logprobs))
            with self._lock:
                self._handles.discard(handle)

    def _logprobs_of(self, choice: dict) -> list[TokenLogprobs]:
        """A chunk's TokenLogprobs (the server's `logprobs_by_id`); the texts its OpenAI logprobs give those
        tokens are remembered."""
        entries = [TokenLogprobs.from_dict(d) for d in choice.get("logprobs_by_id") or []]
        self.token_texts.update(texts_by_id(entries, choice.get("logprobs")))
        return entries

    def abort(self, handle: RemoteHandle | int) -> None:
        """Close the request's stream (the server frees its blocks); unknown or finished ids are ignored."""
        if not isinstance(handle, RemoteHandle):
            with self._lock:
                handle = next((h for h in self._handles if h.id == int(handle)), None)
        if handle is not None and handle.task is not None:
            self._loop.call_soon_threadsafe(handle.task.cancel)

    # Teaching mode holds the engine loop; a server's engine serves others and cannot be held from here.
    def pause(self) -> None:
        raise RuntimeError("teaching mode needs the engine in this process; it is not available with --attach")

    def step_once(self, timeout: float = 30.0) -> EngineSnapshot:
        self.pause()

    def resume(self) -> None:
        pass  # never paused

    @property
    def can_pause(self) -> bool:
        return False

    @property
    def paused(self) -> bool:
        return False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop following the server and end this client's own requests there; the server keeps running."""
        if not self._thread.is_alive():
            return

        async def shutdown():
            with self._lock:
                tasks = [h.task for h in self._handles if h.task is not None]
            for task in tasks + self._background:
                task.cancel()
            await asyncio.gather(*tasks, *self._background, return_exceptions=True)
            await self._client.aclose()

        self._call(shutdown(), timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _error_fields(response: httpx.Response) -> tuple[str, str | None]:
    """The message and code of an OpenAI-shaped error body, else the body itself and no code."""
    try:
        error = response.json()["error"]
        return error["message"], error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return response.text, None


def _error_message(response: httpx.Response) -> str:
    return _error_fields(response)[0]


def _refusal(response: httpx.Response) -> ValueError:
    """A refused request as the local engine would have raised it."""
    message, code = _error_fields(response)
    return (PromptTooLong if code == CONTEXT_LENGTH_EXCEEDED else ValueError)(message)


def _describe(e: Exception) -> str:
    return str(e) or type(e).__name__  # httpx's timeouts carry no message
