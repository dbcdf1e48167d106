"""Run the app under uvicorn until SIGTERM/SIGINT, then shut down gracefully.

uvicorn alone, on a signal, closes the listener and waits for connections for
`timeout_graceful_shutdown`, then cancels the request tasks: streams are cut
mid-chunk (clients see "incomplete chunked read", no finish_reason, no
[DONE]) and every cancelled task logs a CancelledError traceback. And it
re-raises SIGTERM once done, so the process dies of it instead of exiting 0.

Here the first signal also starts the AsyncEngine's drain: requests in flight
may finish for up to `shutdown_timeout` seconds, then each remaining one gets
its final output with finish_reason "abort", so the endpoints end every
response themselves (a last chunk and `data: [DONE]`; a non-streaming
response with the text so far). Only then do the connections close, the
app's lifespan stops the step loop, and the process exits 0. A second signal
aborts what is left at once; a third lets uvicorn force its way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.core.error_shapes import ErrorShapes
from kvserve.server.core.errors import APIError

log = logging.getLogger(__name__)

# After the drain, responses still have to be written out; past this much more,
# uvicorn cancels what is left (a client that stopped reading).
_FLUSH_GRACE_S = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(app, sock: socket.socket, async_engine: AsyncEngine, shutdown_timeout: float) -> None:
    """Serve `app` on the already bound `sock` until a signal, then drain (see the module docstring)."""
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout + _FLUSH_GRACE_S)
    # Passing the socket itself (not its fd, which uvicorn would duplicate) lets the shutdown close the
    # listener for real: new connections are refused instead of waiting in a backlog nobody accepts.
    _DrainingServer(config, async_engine, shutdown_timeout).run(sockets=[sock])


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout
        self._num_signals = 0
        self._drains: set[asyncio.Task] = set()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, minus re-raising the signal afterwards: a graceful shutdown exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A Python signal handler runs on the main thread, which runs the event loop: schedule, don't await.
        self._num_signals += 1
        if self._num_signals > 2:
            self.force_exit = True
            return
        timeout = self.shutdown_timeout if self._num_signals == 1 else 0.0
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # before the loop runs (startup): nothing in flight to drain
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name, timeout)
        self.should_exit = True  # uvicorn closes the listener and waits for the connections to end

    def _start_drain(self, name: str, timeout: float) -> None:
        task = asyncio.create_task(self._drain(name, timeout))
        self._drains.add(task)  # keep a reference until it is done
        task.add_done_callback(self._drains.discard)

    async def _drain(self, name: str, timeout: float) -> None:
        in_flight = self.async_engine.num_in_flight
        log.info("%s: shutting down; %d request(s) in flight may finish within %gs", name, in_flight, timeout)
        num_aborted = await self.async_engine.drain(timeout)
        if num_aborted:
            log.info("shutdown: %d request(s) still running after %gs ended with finish_reason 'abort'",
                     num_aborted, timeout)


class RefuseWhileDraining:
    """Once shutdown has begun, new generation requests get 503 (the ones in flight finish or end with
    finish_reason "abort"). Plain ASGI, so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, async_engine: AsyncEngine, shapes: ErrorShapes | None = None) -> None:
        self.app = app
        self.async_engine = async_engine
        self.shapes = shapes or ErrorShapes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.async_engine.draining:
            error = APIError(503, "The server is shutting down and accepts no new requests; retry on another "
                                  "instance or after it restarts.", type="server_error", code="shutting_down")
            await self.shapes.response(scope["path"], error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
