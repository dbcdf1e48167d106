"""OpenAI's Responses API: /v1/responses and its stored responses (get, delete, input items),
/v1/responses/compact, and the Conversations API (/v1/conversations and its items)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request

from kvserve.server.core.auth import api_key_dependency
from kvserve.server.core.errors import error_responses
from kvserve.server.compaction.summarizer import Summarizer
from kvserve.server.core.serving import Serving
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.responses.compacting import ResponsesCompaction
from kvserve.server.responses.conversations import ConversationsServing, StoredConversation
from kvserve.server.responses.protocol import (CompactRequest, ConversationCreate, ConversationItemsCreate,
                                               ConversationUpdate, ResponsesRequest)
from kvserve.server.responses.serving import ResponsesServing
from kvserve.server.responses.store import ResponsesStore


def responses_store(serving: Serving) -> ResponsesStore:
    """The store the settings describe: in memory, and in `responses_store_path` when one is set."""
    settings = serving.settings
    directory = Path(settings.responses_store_path) if settings.responses_store_path is not None else None
    return ResponsesStore(settings.responses_store_max_count, settings.responses_store_max_bytes, directory)


def conversations_store(serving: Serving) -> ResponsesStore:
    """Conversations, in the same bounds and directory as the responses (their own files: conv_*.json)."""
    settings = serving.settings
    directory = Path(settings.responses_store_path) if settings.responses_store_path is not None else None
    return ResponsesStore(settings.responses_store_max_count, settings.responses_store_max_bytes, directory,
                          kind=StoredConversation)


def responses_router(serving: Serving, store: ResponsesStore, summarizer: Summarizer) -> APIRouter:
    router = APIRouter()
    api_key = api_key_dependency(serving.tenancy)
    conversations = ConversationsServing(conversations_store(serving))
    responses = ResponsesServing(serving, store, ResponsesCompaction(summarizer, store), conversations)

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

    @router.post("/v1/responses/compact", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
    async def compact_response(body: CompactRequest, key: str = Depends(api_key)) -> dict:
        return await responses.compact(body, key)

    @router.post("/v1/conversations", responses=error_responses(400, 401, 413))
    async def create_conversation(body: ConversationCreate, key: str = Depends(api_key)) -> dict:
        return conversations.create(body, tenant_id(key))

    @router.get("/v1/conversations/{conversation_id}", responses=error_responses(401, 404))
    async def get_conversation(conversation_id: str, key: str = Depends(api_key)) -> dict:
        return conversations.retrieve(conversation_id, tenant_id(key))

    @router.post("/v1/conversations/{conversation_id}", responses=error_responses(400, 401, 404))
    async def update_conversation(conversation_id: str, body: ConversationUpdate, key: str = Depends(api_key)) -> dict:
        return conversations.update(conversation_id, body, tenant_id(key))

    @router.delete("/v1/conversations/{conversation_id}", responses=error_responses(401, 404))
    async def delete_conversation(conversation_id: str, key: str = Depends(api_key)) -> dict:
        return conversations.delete(conversation_id, tenant_id(key))

    @router.get("/v1/conversations/{conversation_id}/items", responses=error_responses(400, 401, 404))
    async def list_conversation_items(conversation_id: str, key: str = Depends(api_key), limit: int = Query(20),
                                      order: str = Query("desc"), after: str | None = Query(None)) -> dict:
        return conversations.list_items(conversation_id, tenant_id(key), limit, order, after)

    @router.post("/v1/conversations/{conversation_id}/items", responses=error_responses(400, 401, 404))
    async def create_conversation_items(conversation_id: str, body: ConversationItemsCreate,
                                        key: str = Depends(api_key)) -> dict:
        return conversations.add_items(conversation_id, body, tenant_id(key))

    @router.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=error_responses(401, 404))
    async def get_conversation_item(conversation_id: str, item_id: str, key: str = Depends(api_key)) -> dict:
        return conversations.get_item(conversation_id, item_id, tenant_id(key))

    @router.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=error_responses(401, 404))
    async def delete_conversation_item(conversation_id: str, item_id: str, key: str = Depends(api_key)) -> dict:
        return conversations.delete_item(conversation_id, item_id, tenant_id(key))

    return router
