"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kvserve.server.anthropic.messages import MessagesServing
from kvserve.server.anthropic.protocol import MessagesPrompt, MessagesRequest
from kvserve.server.compaction.summarizer import Summarizer
from kvserve.server.core.auth import api_key_dependency
from kvserve.server.core.errors import error_responses
from kvserve.server.core.serving import Serving


def messages_router(serving: Serving, summarizer: Summarizer | None = None) -> APIRouter:
    router = APIRouter()
    # Anthropic's clients send `x-api-key`; a Bearer header works too. Both name the same tenants.
    api_key = api_key_dependency(serving.tenancy, accept_x_api_key=True)
    messages = MessagesServing(serving, summarizer)

    @router.post("/v1/messages", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
    async def create_message(body: MessagesRequest, request: Request, key: str = Depends(api_key)):
        return await messages.create(body, request, key)

    @router.post("/v1/messages/count_tokens", responses=error_responses(400, 401, 404, 413, 503))
    async def count_message_tokens(body: MessagesPrompt, key: str = Depends(api_key)) -> dict:
        return await messages.count_tokens(body, key)

    return router
