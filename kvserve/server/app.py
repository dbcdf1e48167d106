"""The HTTP application: routes, authentication, and errors in OpenAI's shape."""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import AsyncEngine, EngineFailedError
from kvserve.engine.engine import Engine
from kvserve.errors import (InvalidRequestError, KVServeError, RequestFailedError, TokenizerUnavailableError,
                            UnsupportedModelError)
from kvserve.server.errors import APIError, bad_request, internal, unauthorized
from kvserve.server.metrics import ServerMetrics, log_request
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.serving import OpenAIServing, ServerSettings

log = logging.getLogger(__name__)

disable_created_metrics()  # the *_created series only add noise to every scrape


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; the step loop starts and stops with the app's lifespan."""
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(async_engine, settings.model_name)
    async_engine.observers += [metrics.observe, log_request]
    serving = OpenAIServing(async_engine, settings)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        yield
        await async_engine.stop()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.async_engine = async_engine

    async def api_key(request: Request) -> str:
        key = serving.tenancy.authenticate(request.headers.get("authorization"))
        if key is None:
            raise unauthorized()
        return key

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.running:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(_: str = Depends(api_key)) -> dict:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": created, "owned_by": "kvserve",
            "max_model_len": engine.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: str = Depends(api_key)):
        return await serving.completions(body, request, key)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, key: str = Depends(api_key)):
        return await serving.chat(body, request, key)

    @app.get("/v1/kv_cache")
    async def kv_cache(_: str = Depends(api_key)) -> dict:
        """The pool right now, and a full block-accounting check (run between steps)."""
        return await async_engine.call(lambda: _kv_cache_report(engine))

    _install_error_handlers(app)
    return app


def _kv_cache_report(engine: Engine) -> dict:
    kv = engine.kv_manager
    try:
        engine.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = f"FAILED: {exc}"
    return {
        "block_size": kv.block_size, "num_blocks": kv.num_blocks, "num_used_blocks": kv.num_used_blocks,
        "num_free_blocks": kv.num_free_blocks, "num_cached_blocks": kv.num_cached_blocks,
        "capacity_tokens": kv.num_blocks * kv.block_size, "bytes_per_token": engine.kv_spec.bytes_per_token,
        "dtype": engine.kv_spec.dtype, "pool_bytes": engine.kv_cache.bytes_allocated,
        "num_requests_running": len(engine.scheduler.running), "num_requests_waiting": len(engine.scheduler.waiting),
        "prefix_cache_queries": engine.prefix_cache_queries, "prefix_cache_hits": engine.prefix_cache_hits,
        "num_preemptions": engine.scheduler.num_preemptions, "integrity": integrity,
    }


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line: the first problem of each offending field (pydantic lists one per union member)."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "The request body is not valid JSON.", None
    by_field: dict[str, str] = {}
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        field = loc[0] if loc else ""
        if field not in by_field:
            where = ".".join(p for p in loc if p not in ("str", "int", "float", "list[int]", "list[str]")) or "body"
            message = "must be a JSON object" if not field else error.get("msg", "is invalid")
            by_field[field] = f"{where}: {message}"
    param = next((f for f in by_field if f), None)
    return "Invalid request: " + "; ".join(list(by_field.values())[:5]), param


def _install_error_handlers(app: FastAPI) -> None:
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
