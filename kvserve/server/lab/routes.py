"""The lab's HTTP routes: four static pages under /lab and their data under /lab/api (admin-guarded)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, Field

from kvserve.config import ModelConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.kv.state.state_spec import state_spec
from kvserve.server.core.errors import APIError, RETRY_AFTER_S, bad_request
from kvserve.server.core.serving import Serving
from kvserve.server.lab.access import LabAccess
from kvserve.server.lab.feed import FeedSettings, feed_events, fresh_snapshot, snapshot_json
from kvserve.server.lab.kept import kept_json, kept_summary
from kvserve.server.lab.kv_layers import kv_layers_info
from kvserve.server.lab.memory import MemoryQuery, ServedModel, catalog, memory_plan
from kvserve.server.compaction.summarizer import COMPACTION_PASS_PREFIX
from kvserve.server.lab.recent import RecentRequests, explanation_json
from kvserve.server.lab.steps import StepsBusyError, StepsRunner

STATIC_DIR = Path(__file__).parent / "static"
PAGES = {"": "cache.html", "/memory": "memory.html", "/steps": "steps.html", "/explain": "explain.html",
         "/kept": "kept.html"}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StepsBody(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = 16


class ExplainBody(BaseModel):
    """Either a prompt to look up now, or the id of a recent request."""

    prompt: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    tenant: int | None = None  # 1-based, in --api-key order: whose cache to look in


def lab_router(async_engine: AsyncEngine, serving: Serving, access: LabAccess, recent: RecentRequests,
               steps: StepsRunner, feed: FeedSettings) -> APIRouter:
    engine = async_engine.engine
    settings = serving.settings
    served = ServedModel(settings.model_name, engine.loaded.config)
    router = APIRouter()

    for suffix, filename in PAGES.items():
        for path in {f"/lab{suffix}", f"/lab{suffix}/"}:
            router.add_api_route(path, _page(filename), methods=["GET"], include_in_schema=False)

    async def admin(request: Request) -> None:
        access.check(request.headers.get("authorization"))

    api = APIRouter(prefix="/lab/api", dependencies=[Depends(admin)], include_in_schema=False)

    @api.get("/info")
    async def info() -> dict:
        stats = engine.stats()
        return {
            "model": settings.model_name, "block_size": stats.block_size, "num_blocks": stats.num_blocks,
            "bytes_per_token": engine.kv_spec.bytes_per_token, "kv_dtype": engine.kv_spec.dtype,
            "pool_bytes": engine.pool_bytes, "num_layers": engine.loaded.config.num_layers,
            "log_prompts": settings.log_prompts, "num_tenants": len(serving.tenancy.api_keys),
            "steps": {"max_prompt_tokens": steps.limits.max_prompt_tokens,
                      "max_new_tokens": steps.limits.max_new_tokens},
            "feed_interval_s": feed.interval_s,
            "kv_formula": engine.kv_spec.formula(stats.block_size),
            "attention_layers": engine.kv_spec.num_layers,
            "recurrent_state": _recurrent_state_info(engine.loaded.config),
            "kv_layers": kv_layers_info(engine.kv_spec, engine.loaded.config),
        }

    @api.get("/snapshot")
    async def snapshot() -> dict:
        """One snapshot with a block view of the current step (the page's first paint; tests)."""
        return snapshot_json(await fresh_snapshot(async_engine))

    @api.get("/feed")
    async def live_feed() -> StreamingResponse:
        return StreamingResponse(feed_events(async_engine, feed), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)

    @api.get("/models")
    async def models() -> dict:
        return catalog(served)

    @api.get("/memory")
    async def memory(
        model: str | None = None, context: int | None = Query(None, ge=1), batch: int = Query(1, ge=1),
        kv_dtype: str = "float16", weights_dtype: str = "float16", memory: str | None = None,
        block_size: int = Query(16, ge=1), overhead: float = Query(0.1, ge=0), layers: int | None = Query(None, ge=1),
        kv_heads: int | None = Query(None, ge=1), head_dim: int | None = Query(None, ge=1),
        heads: int | None = Query(None, ge=1), params: float | None = Query(None, gt=0),
        kv_compression: str | None = None, max_tokens: int = Query(0, ge=0),
    ) -> dict:
        query = MemoryQuery(model or served.name, context, batch, kv_dtype, weights_dtype, memory or None, block_size,
                            overhead, layers, kv_heads, head_dim, heads, params, kv_compression or None, max_tokens)
        return await serving.off_loop(memory_plan, query, served)

    @api.get("/kept")
    async def kept_requests() -> dict:
        """The requests whose kept tokens are recorded. The first call starts the recording (nothing is recorded
        while no page asked: compactions before it have no record)."""
        kept = engine.kept_tokens

        def enable_and_list() -> list:
            kept.enable()
            return kept.requests()

        records = await async_engine.call(enable_and_list)
        return {"compression": engine.config.kv_compression, "keep_finished": kept.keep_finished,
                "requests": [kept_summary(r) for r in records]}

    @api.get("/kept/{request_id}")
    async def kept_request(request_id: str) -> dict:
        record = await async_engine.call(lambda: engine.kept_tokens.get(request_id))
        if record is None:
            raise APIError(404, f"no kept-token record for {request_id!r} (recorded from the first visit to "
                                f"/lab/kept on, for running requests and the last {engine.kept_tokens.keep_finished} "
                                f"finished ones)", type="not_found_error")
        return await serving.off_loop(kept_json, record)

    @api.post("/steps")
    async def run_steps(body: StepsBody) -> StreamingResponse:
        token_ids = await serving.off_loop(serving.prompts.encode_text, body.prompt, "prompt")
        try:
            events = steps.start(token_ids, body.max_tokens)
        except StepsBusyError:
            raise APIError(429, "A cached-vs-recomputed run is already in progress; one runs at a time.",
                           type="rate_limit_error", code="lab_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return StreamingResponse(_sse(events), media_type="text/event-stream", headers=_SSE_HEADERS)

    @api.get("/recent")
    async def recent_requests() -> dict:
        return {"log_prompts": settings.log_prompts, "requests": [{
            "id": r.request_id, "finished_at": r.finished_at, "prompt_tokens": r.num_prompt_tokens,
            "cached_tokens": r.report.num_cached_tokens, "output_tokens": r.num_output_tokens,
            "finish_reason": r.finish_reason, "ttft": r.ttft, "tpot": r.tpot, "reason": r.report.reason,
            "divergence_position": r.report.divergence_position,
            # the KV it held when it finished (prompt + output), and whether it was a compaction pass
            # (server/compaction/): the pass holds the whole history, the answer after it the summary
            "kv_tokens": r.num_prompt_tokens + r.num_output_tokens,
            "compaction_pass": r.request_id.startswith(COMPACTION_PASS_PREFIX)} for r in recent.newest_first()]}

    @api.post("/explain")
    async def explain(body: ExplainBody) -> dict:
        tokenizer = serving.tokenizer
        if body.request_id is not None:
            found = recent.get(body.request_id)
            if found is None:
                raise APIError(404, f"no recent request {body.request_id!r} (the lab keeps the last "
                                    f"{recent.size} finished ones)", type="not_found_error")
            return await serving.off_loop(explanation_json, found.report, found.prompt_token_ids, tokenizer,
                                          settings.log_prompts, settings.log_prompts)
        if body.prompt is None:
            raise bad_request("give a prompt or a request_id")
        token_ids = await serving.off_loop(serving.prompts.encode_text, body.prompt, "prompt")
        salt = serving.tenancy.cache_salt(serving.tenancy.key_of_tenant(body.tenant), body.cache_salt)
        report = await async_engine.call(lambda: engine.explain_prompt(token_ids, salt))
        # The pasted prompt's own text is the caller's; the cached side is someone else's prompt.
        return await serving.off_loop(explanation_json, report, token_ids, tokenizer, True, settings.log_prompts)

    router.include_router(api)
    return router


def _recurrent_state_info(config: ModelConfig) -> dict | None:
    """A hybrid model's state kind for the pages: its layers, one request's bytes and the formula."""
    states = state_spec(config)
    if states is None:
        return None
    return {"layers": states.num_layers, "slot_bytes": states.slot_bytes, "formula": states.formula()}


def _page(filename: str):
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / filename, media_type="text/html")

    return page


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for event in events:
        yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
