"""The request guards in front of the app, and the limits they hold it to: the API key, the JSON-only
content type, the body size cap, the error answers they give (counted in zipage_errors_total), and
`ServeLimits`, everything a client may send or hold and how the server stops (docs/serving.md)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from zipage.cli.serve import openai_protocol as api
from zipage.cli.serve.metrics import ServerMetrics

OPEN_PATHS = ("/health",)  # reachable without the API key
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
