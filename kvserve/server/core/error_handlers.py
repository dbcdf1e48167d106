"""Every error a route can raise, answered in its API's error shape (core/error_shapes.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import EngineFailedError
from kvserve.errors import (InvalidRequestError, KVServeError, RequestFailedError, TokenizerUnavailableError,
                            UnsupportedModelError)
from kvserve.server.core.error_shapes import ErrorShapes
from kvserve.server.core.errors import APIError, bad_request, internal

log = logging.getLogger(__name__)


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line: the most telling problem of each offending field. Pydantic reports one
    error per union member ("should be a valid string" for a field that is also allowed to be a
    list); an error of our own (a lone surrogate, an image part) says more than a type mismatch,
    and a mismatch deep inside a value more than one at its top."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "The request body is not valid JSON.", None
    by_field: dict[str, tuple[tuple[int, int], str]] = {}
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        field = loc[0] if loc else ""
        rank = (1 if error.get("type", "").endswith("_type") else 0, -len(loc))
        if field not in by_field or rank < by_field[field][0]:
            message = "must be a JSON object" if not field else error.get("msg", "is invalid")
            by_field[field] = (rank, f"{'.'.join(loc) or 'body'}: {message}")
    param = next((f for f in by_field if f), None)
    return "Invalid request: " + "; ".join(line for _, line in list(by_field.values())[:5]), param


def _is_union_tag(part: object) -> bool:
    """Pydantic names the union member in the error location ('str', 'list[int]',
    'function-after[...]'); field names never look like that."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


# What kvserve serves, named in the 404 for any other path (e.g. /v1/embeddings).
SERVED_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                    "/v1/messages/count_tokens", "/v1/kv_cache", "/api/chat", "/api/generate", "/api/tags", "/api/show")


def unsupported_endpoint(method: str, path: str) -> APIError:
    return APIError(404, f"{method} {path} is not supported by this server (kvserve serves text generation: "
                         f"{', '.join(SERVED_ENDPOINTS)})", type="not_found_error", code="unsupported_endpoint")


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    """Answer each exception kind with its status and its API's error body."""

    def answer(request: Request, error: APIError):
        return shapes.response(request.url.path, error)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = _describe_validation_error(exc)
        return answer(request, bad_request(message, param))

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError):
        return answer(request, bad_request(str(exc), exc.param))

    @app.exception_handler(TokenizerUnavailableError)
    @app.exception_handler(UnsupportedModelError)
    async def unsupported(request: Request, exc: KVServeError):
        return answer(request, bad_request(str(exc)))

    @app.exception_handler(EngineFailedError)
    @app.exception_handler(RequestFailedError)
    async def engine_failed(request: Request, exc: KVServeError):
        return answer(request, internal(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route matched the path
            return answer(request, unsupported_endpoint(request.method, request.url.path))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # exc.headers carries a 405's Allow header (RFC 9110: a 405 must list the methods allowed).
        return answer(request, APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error while handling a request")
        return answer(request, internal(f"internal error: {type(exc).__name__}"))
