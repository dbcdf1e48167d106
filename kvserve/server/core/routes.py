"""Routes every API shares: /health (for load balancers), /metrics (Prometheus) and /v1/kv_cache
(the pool right now, with a block-accounting check)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.errors import KVIntegrityError
from kvserve.server.core.errors import error_responses
from kvserve.server.core.metrics import ServerMetrics


def health_router(async_engine: AsyncEngine, metrics: ServerMetrics) -> APIRouter:
    """/health and /metrics: open to anyone who can reach the port, as probes and scrapers expect."""
    router = APIRouter()

    @router.get("/health", responses={
        503: {"description": "The server is shutting down, or the engine's step loop has stopped."}})
    async def health() -> Response:
        if async_engine.draining:  # out of the load balancer's rotation while in-flight requests finish
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not async_engine.running:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text exposition format (version 0.0.4).",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def kv_cache_router(async_engine: AsyncEngine, api_key: Callable[..., Awaitable[str]]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/kv_cache", responses=error_responses(401))
    async def kv_cache(_: str = Depends(api_key)) -> dict:
        """The pool right now, and a full block-accounting check (run between steps)."""
        return await async_engine.call(lambda: kv_cache_report(async_engine.engine))

    return router


def kv_cache_report(engine: Engine) -> dict:
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
        "dtype": engine.kv_spec.dtype, "pool_bytes": engine.pool_bytes,
        "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
        "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps, "integrity": integrity,
        "tier": dataclasses.asdict(stats.tier) if stats.tier is not None else None,
        "pins": dataclasses.asdict(stats.pins) if stats.pins is not None else None,
    }
