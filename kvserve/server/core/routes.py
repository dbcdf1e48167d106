"""Routes every API shares: /health (for load balancers), /metrics (Prometheus) and /v1/kv_cache
(the pool right now, with a block-accounting check: core/kv_report.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.core.errors import error_responses
from kvserve.server.core.kv_report import kv_cache_report, tenant_view
from kvserve.server.core.metrics import ServerMetrics
from kvserve.server.core.pin_owners import PinOwners


def health_router(async_engine: AsyncEngine, metrics: ServerMetrics, metrics_guard: Callable[..., Awaitable[None]]
                  ) -> APIRouter:
    """/health, open to anyone who can reach the port as probes expect, and /metrics: open as scrapers
    expect unless --metrics-key is set (`metrics_guard`)."""
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
        "content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)})
    async def prometheus_metrics(_: None = Depends(metrics_guard)) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def kv_cache_router(async_engine: AsyncEngine, viewer: Callable[..., Awaitable[str | None]],
                    owners: PinOwners) -> APIRouter:
    router = APIRouter()
    engine = async_engine.engine

    @router.get("/v1/kv_cache", responses=error_responses(401))
    async def kv_cache(tenant: str | None = Depends(viewer)) -> dict:
        """The pool right now, and a full block-accounting check (run between steps); a tenant sees its
        own pins and the pool's occupancy, the admin key everything (core/kv_report.py)."""
        report = await async_engine.call(lambda: kv_cache_report(engine))
        if tenant is None:
            return {**report, "visible_to": "admin"}
        return tenant_view(report, tenant, owners)

    return router
