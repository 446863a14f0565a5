"""Running the app on uvicorn until it stops: `serve`, uvicorn's settings for slow, idle or too many
clients, the request-head deadline, the graceful server that starts the shutdown grace as it stops
accepting, and SIGTERM turned into an exit the caller can clean up after."""

from __future__ import annotations

import signal
import threading

from zipage.engine.api.process import EngineProcess
from zipage.cli.serve.engine_client import EngineClient
from zipage.cli.serve.guards import ServeLimits
from zipage.cli.serve.server import create_app
from zipage.cli.serve.serving import ShutdownGrace

SHUTDOWN_BACKSTOP_S = 2.0  # past the grace, how long uvicorn waits for the streams it ended to close
MAX_HEADER_BYTES = 16 * 1024  # a request head still unfinished past this is refused with 400 (h11's default)


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
