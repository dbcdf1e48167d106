"""A request-body size limit (`--max-request-bytes`), enforced before any handler runs.

A body announced larger than the limit (Content-Length) is refused without
reading it; a chunked body is read up to the limit and refused as soon as it
passes it. Either way the answer is 413 with the limit in the message, so a
20 MB paste costs the server nothing but the bytes it already received.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import request_too_large


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await request_too_large(self.max_bytes, int(declared)).response()(scope, receive, send)
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
                await request_too_large(self.max_bytes).response()(scope, receive, send)
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
