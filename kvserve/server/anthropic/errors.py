"""Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}} with the HTTP status.

The types are Anthropic's own per status, as its SDK maps them to exception classes.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvserve.server.core.errors import APIError

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error",
}

# Anthropic's clients send `x-api-key`; OpenAI's hint (a Bearer header) would mislead them.
_UNAUTHORIZED = "Incorrect or missing API key: send it as 'x-api-key: <key>' (or 'Authorization: Bearer <key>')."


def anthropic_error_response(error: APIError) -> JSONResponse:
    message = _UNAUTHORIZED if error.status == 401 and error.code == "invalid_api_key" else error.message
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=error.status,
                        headers=error.headers or None)
