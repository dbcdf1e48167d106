"""OpenAI's Responses API: /v1/responses and its stored responses (get, delete, input items)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request

from kvserve.server.core.auth import api_key_dependency
from kvserve.server.core.errors import error_responses
from kvserve.server.core.serving import Serving
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.serving import ResponsesServing
from kvserve.server.responses.store import ResponsesStore


def responses_store(serving: Serving) -> ResponsesStore:
    """The store the settings describe: in memory, and in `responses_store_path` when one is set."""
    settings = serving.settings
    directory = Path(settings.responses_store_path) if settings.responses_store_path is not None else None
    return ResponsesStore(settings.responses_store_max_count, settings.responses_store_max_bytes, directory)


def responses_router(serving: Serving, store: ResponsesStore) -> APIRouter:
    router = APIRouter()
    api_key = api_key_dependency(serving.tenancy)
    responses = ResponsesServing(serving, store)

    @router.post("/v1/responses", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
    async def create_response(body: ResponsesRequest, request: Request, key: str = Depends(api_key)):
        return await responses.create(body, request, key)

    @router.get("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def get_response(response_id: str, key: str = Depends(api_key)) -> dict:
        return responses.get(response_id, key)

    @router.delete("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def delete_response(response_id: str, key: str = Depends(api_key)) -> dict:
        return responses.delete(response_id, key)

    @router.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404))
    async def response_input_items(response_id: str, key: str = Depends(api_key), limit: int = Query(20),
                                   order: str = Query("desc"), after: str | None = Query(None)) -> dict:
        return responses.input_items(response_id, key, limit, order, after)

    return router
