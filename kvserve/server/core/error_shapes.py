"""Which API's error body a path answers with: OpenAI's by default, another API's under its prefix.

Every error a request can meet (a route's APIError, a validation error, an unknown path, the body
limit and the shutdown refusal in the middlewares) is rendered here, so a client of each API reads
its errors in the shape its SDK parses (Anthropic's SDK raises `AuthenticationError` from
`{"type": "error", "error": {"type": "authentication_error", ...}}`, not from OpenAI's shape).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse

from kvserve.server.core.errors import APIError

ErrorRenderer = Callable[[APIError], JSONResponse]


def openai_error_response(error: APIError) -> JSONResponse:
    return error.response()


class ErrorShapes:
    def __init__(self) -> None:
        self._by_prefix: list[tuple[str, ErrorRenderer]] = []

    def register(self, prefix: str, render: ErrorRenderer) -> None:
        """Errors on `prefix` and the paths under it are rendered by `render`."""
        self._by_prefix.append((prefix.rstrip("/"), render))

    def response(self, path: str, error: APIError) -> JSONResponse:
        for prefix, render in self._by_prefix:
            if path == prefix or path.startswith(prefix + "/"):
                return render(error)
        return openai_error_response(error)
