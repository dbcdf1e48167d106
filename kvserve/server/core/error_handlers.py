"""Every error a route can raise, answered in OpenAI's error shape (core/errors.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import EngineFailedError
from kvserve.errors import (InvalidRequestError, KVServeError, RequestFailedError, TokenizerUnavailableError,
                            UnsupportedModelError)
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


def install_error_handlers(app: FastAPI) -> None:
    """Answer each exception kind with its status and an OpenAI-shaped body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        message, param = _describe_validation_error(exc)
        return bad_request(message, param).response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError):
        return bad_request(str(exc), exc.param).response()

    @app.exception_handler(TokenizerUnavailableError)
    @app.exception_handler(UnsupportedModelError)
    async def unsupported(_: Request, exc: KVServeError):
        return bad_request(str(exc)).response()

    @app.exception_handler(EngineFailedError)
    @app.exception_handler(RequestFailedError)
    async def engine_failed(_: Request, exc: KVServeError):
        return internal(str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unexpected error while handling a request")
        return internal(f"internal error: {type(exc).__name__}").response()
