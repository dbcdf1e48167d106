"""The HTTP application: each API's router over the shared core, and the lifespan of the step loop."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import disable_created_metrics

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.platform import freeze_startup_heap, unfreeze_heap
from kvserve.server.anthropic import messages_router
from kvserve.server.anthropic.errors import anthropic_error_response
from kvserve.server.core.auth import metrics_guard, pool_viewer_dependency
from kvserve.server.core.body_limit import BodyLimitMiddleware
from kvserve.server.core.error_handlers import install_error_handlers
from kvserve.server.core.error_shapes import ErrorShapes
from kvserve.server.core.errors import drop_validation_responses
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.core.metrics import ServerMetrics, log_request
from kvserve.server.core.routes import health_router, kv_cache_router
from kvserve.server.core.serving import ServerSettings, Serving
from kvserve.server.core.shutdown import RefuseWhileDraining
from kvserve.server.lab import mount_lab
from kvserve.server.ollama import ollama_router
from kvserve.server.ollama.router import ollama_error_response
from kvserve.server.openai import openai_router
from kvserve.server.compaction.sealing import Sealer, server_secret
from kvserve.server.compaction.summarizer import Summarizer
from kvserve.server.responses import responses_router, responses_store

disable_created_metrics()  # the *_created series only add noise to every scrape


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; the step loop starts and stops with the app's lifespan."""
    async_engine = AsyncEngine(engine)
    tenant_labels = {tenant_id(key): str(number) for number, key in enumerate(settings.api_keys, 1)}
    metrics = ServerMetrics(async_engine, settings.model_name, tenant_labels)
    async_engine.observers += [metrics.observe, log_request]
    serving = Serving(async_engine, settings)
    serving.count_tool_calls = metrics.count_tool_calls
    store = responses_store(serving)
    directory = Path(settings.responses_store_path) if settings.responses_store_path is not None else None
    summarizer = Summarizer(serving, Sealer(server_secret(settings.compaction_secret, directory)))

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
    app.state.responses_store = store
    app.state.answers = serving.answers  # a replica forwards what it remembers to the ingress
    shapes = ErrorShapes()
    shapes.register("/v1/messages", anthropic_error_response)  # Anthropic's SDK reads its own error shape
    shapes.register("/api", ollama_error_response)  # Ollama's clients read `{"error": "..."}`
    app.add_middleware(RefuseWhileDraining, async_engine=async_engine, shapes=shapes)

    metrics_keys = [key for key in (settings.metrics_key, settings.admin_key) if key] if settings.metrics_key else []
    app.include_router(health_router(async_engine, metrics, metrics_guard(metrics_keys)))
    app.include_router(openai_router(serving))
    app.include_router(messages_router(serving, summarizer))
    app.include_router(responses_router(serving, store, summarizer))
    app.include_router(ollama_router(serving))
    app.include_router(kv_cache_router(async_engine, pool_viewer_dependency(serving.tenancy, settings.admin_key),
                                       serving.pin_owners))
    mount_lab(app, async_engine, serving)
    install_error_handlers(app, shapes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes, shapes=shapes)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = drop_validation_responses(get_openapi(
                title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    return app
