"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with the HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

# Seconds a client should wait before retrying a request refused because the queue is full.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error the server answers with a status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        # A message may quote the request (a field path, a model name): drop lone surrogates,
        # which cannot be encoded as UTF-8 and would turn this answer into a 500.
        message = message.encode("utf-8", "replace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param.encode("utf-8", "replace").decode("utf-8") if param else param
        self.code = code
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def overloaded(waiting: int, limit: int) -> APIError:
    return APIError(429, f"The server is at capacity ({waiting} requests waiting, limit {limit}); retry later.",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


def tenant_overloaded(waiting: int, limit: int) -> APIError:
    return APIError(429, f"This API key has {waiting} requests waiting, its share of the server's queue is {limit} "
                         f"(--max-waiting-requests shared by --tenant-weights); retry later.",
                    type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


def request_too_large(limit: int, size: int | None = None) -> APIError:
    size_text = f" ({size:,} bytes)" if size is not None else ""
    return APIError(413, f"The request body{size_text} is larger than this server's limit of {limit:,} bytes "
                         f"(--max-request-bytes).", code="request_too_large", headers={"Connection": "close"})


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error")


# --- OpenAPI: what the error answers look like -----------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: a malformed body or a value out of range (the message names the field).",
    401: "Missing or wrong API key.",
    404: "The model does not exist.",
    413: "The request body is larger than --max-request-bytes.",
    429: "The waiting queue is full right now; retry after the Retry-After header's seconds.",
    500: "The engine failed while running the request.",
    503: "The server is shutting down and accepts no new requests.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: the error statuses it can answer, with OpenAI's error body."""
    return {status: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def drop_validation_responses(schema: dict) -> dict:
    """FastAPI documents 422 for every route with a body; kvserve answers 400 instead."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
