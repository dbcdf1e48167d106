"""The HTTP application: routes, authentication, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.engine.async_engine import AsyncEngine, EngineFailedError
from kvserve.engine.engine import Engine
from kvserve.errors import (InvalidRequestError, KVIntegrityError, KVServeError, RequestFailedError,
                            TokenizerUnavailableError, UnsupportedModelError)
from kvserve.platform import freeze_startup_heap, unfreeze_heap
from kvserve.server.body_limit import BodyLimitMiddleware
from kvserve.server.chat import ChatServing
from kvserve.server.completions import CompletionServing
from kvserve.server.errors import (
    APIError, bad_request, drop_validation_responses, error_responses, internal, unauthorized,
)
from kvserve.server.lab import mount_lab
from kvserve.server.metrics import ServerMetrics, log_request
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.serving import ServerSettings, Serving
from kvserve.server.session_routes import install_session_routes

log = logging.getLogger(__name__)

disable_created_metrics()  # the *_created series only add noise to every scrape


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; the step loop starts and stops with the app's lifespan."""
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(async_engine, settings.model_name)
    async_engine.observers += [metrics.observe, log_request]
    serving = Serving(async_engine, settings)
    completion_serving, chat_serving = CompletionServing(serving), ChatServing(serving)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        freeze_startup_heap()
        yield
        unfreeze_heap()
        await async_engine.stop()
        serving.close()
        # The step loop has stopped: the disk tier may finish its queued writes (a restart finds them).
        await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.add_middleware(_RefuseWhileDraining, async_engine=async_engine)

    async def api_key(request: Request) -> str:
        key = serving.tenancy.authenticate(request.headers.get("authorization"))
        if key is None:
            raise unauthorized()
        return key

    @app.get("/health", responses={
        503: {"description": "The server is shutting down, or the engine's step loop has stopped."}})
    async def health() -> Response:
        if async_engine.draining:  # out of the load balancer's rotation while in-flight requests finish
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not async_engine.running:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text exposition format (version 0.0.4).",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(401))
    async def models(_: str = Depends(api_key)) -> dict:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": created, "owned_by": "kvserve",
            "max_model_len": engine.max_model_len,
        }]}

    generation_errors = error_responses(400, 401, 404, 413, 429, 500, 503)

    @app.post("/v1/completions", responses=generation_errors)
    async def completions(body: CompletionRequest, request: Request, key: str = Depends(api_key)):
        return await completion_serving.create(body, request, key)

    @app.post("/v1/chat/completions", responses=generation_errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request, key: str = Depends(api_key)):
        return await chat_serving.create(body, request, key)

    install_session_routes(app, serving, api_key)

    @app.get("/v1/kv_cache", responses=error_responses(401))
    async def kv_cache(_: str = Depends(api_key)) -> dict:
        """The pool right now, and a full block-accounting check (run between steps)."""
        return await async_engine.call(lambda: _kv_cache_report(engine))

    mount_lab(app, async_engine, serving)
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = drop_validation_responses(get_openapi(
                title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    return app


class _RefuseWhileDraining:
    """Once shutdown has begun, new generation requests get 503 (the ones in flight finish or end with
    finish_reason "abort"). Plain ASGI, so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, async_engine: AsyncEngine) -> None:
        self.app = app
        self.async_engine = async_engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.async_engine.draining:
            error = APIError(503, "The server is shutting down and accepts no new requests; retry on another "
                                  "instance or after it restarts.", type="server_error", code="shutting_down")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _kv_cache_report(engine: Engine) -> dict:
    """Run between steps: the snapshot is then the pool as it is now."""
    engine.expire_pins()  # an idle engine runs no step that would sweep them
    stats = engine.stats()
    layout = engine.kv_spec.layout
    try:
        engine.check_integrity()
        integrity = "ok"
    except KVIntegrityError as exc:
        integrity = f"FAILED: {exc}"
    return {
        "block_size": stats.block_size, "num_blocks": stats.num_blocks, "num_used_blocks": stats.num_used_blocks,
        "num_free_blocks": stats.num_free_blocks, "num_cached_blocks": stats.num_cached_blocks,
        "num_cached_free_blocks": stats.num_cached_free_blocks,
        # Tokens every KV group can hold at once (a windowed group frees blocks, so long requests hold fewer).
        "capacity_tokens": stats.num_blocks // layout.num_groups * stats.block_size,
        "bytes_per_token": engine.kv_spec.bytes_per_token,
        "kv_groups": [{"window": group.window, "layers": list(group.layers)} for group in layout.groups],
        "dtype": engine.kv_spec.dtype, "pool_bytes": engine.kv_cache.bytes_allocated,
        "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
        "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps, "integrity": integrity,
        "tier": dataclasses.asdict(stats.tier) if stats.tier is not None else None,
        "pins": dataclasses.asdict(stats.pins) if stats.pins is not None else None,
    }


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
