"""A request-body size limit (`--max-request-bytes`), enforced before any handler runs.

A body announced larger than the limit (Content-Length) is refused without
parsing it; a chunked body is read up to the limit and refused as soon as it
passes it. Either way the answer is 413 with the limit in the message. The
rest of the body is read and dropped first (up to DRAIN_LIMIT_BYTES): a
server that answers while the client is still sending, then closes, resets
the connection, and the client may see the reset instead of the 413 (it did,
now and then, for a 20 MB body). Dropping bytes costs no parsing.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.core.error_shapes import ErrorShapes
from kvserve.server.core.errors import request_too_large


DRAIN_LIMIT_BYTES = 64 * 2**20  # past this much, answer at once and let the connection close


async def _discard_body(receive: Receive) -> None:
    """Read and drop what remains of the request body, up to DRAIN_LIMIT_BYTES."""
    seen = 0
    while seen <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, shapes: ErrorShapes | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.shapes = shapes or ErrorShapes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _discard_body(receive)
            await self.shapes.response(scope["path"], request_too_large(self.max_bytes, int(declared)))(
                scope, receive, send)
            return
        # Read the body here (the handler would read all of it before starting anyway), then
        # hand it on; later receive() calls (disconnect checks) go to the server as before.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _discard_body(receive)
                await self.shapes.response(scope["path"], request_too_large(self.max_bytes))(scope, receive, send)
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
