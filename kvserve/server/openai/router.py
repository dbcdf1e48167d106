"""OpenAI's chat and text completions: /v1/models (and one model), /v1/completions, /v1/chat/completions;
and /tokenize (vLLM's, chat form)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from kvserve.server.core.auth import api_key_dependency
from kvserve.server.core.errors import error_responses, model_not_found
from kvserve.server.core.serving import Serving
from kvserve.server.openai.chat import ChatServing
from kvserve.server.openai.completions import CompletionServing
from kvserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest


def openai_router(serving: Serving) -> APIRouter:
    router = APIRouter()
    api_key = api_key_dependency(serving.tenancy)
    completion_serving, chat_serving = CompletionServing(serving), ChatServing(serving)
    model_name, max_model_len = serving.settings.model_name, serving.engine.max_model_len
    created = int(time.time())

    model = {"id": model_name, "object": "model", "created": created, "owned_by": "kvserve",
             "max_model_len": max_model_len}

    @router.get("/v1/models", responses=error_responses(401))
    async def models(_: str = Depends(api_key)) -> dict:
        return {"object": "list", "data": [model]}

    @router.get("/v1/models/{model_id:path}", responses=error_responses(401, 404))
    async def retrieve_model(model_id: str, _: str = Depends(api_key)) -> dict:
        """One model (openai's `models.retrieve`); ids may contain '/' (org/name)."""
        if model_id != model_name:
            raise model_not_found(model_id)
        return model

    generation_errors = error_responses(400, 401, 404, 413, 429, 500, 503)

    @router.post("/v1/completions", responses=generation_errors)
    async def completions(body: CompletionRequest, request: Request, key: str = Depends(api_key)):
        return await completion_serving.create(body, request, key)

    @router.post("/v1/chat/completions", responses=generation_errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request, key: str = Depends(api_key)):
        return await chat_serving.create(body, request, key)

    @router.post("/tokenize", responses=error_responses(400, 401, 404))
    async def tokenize(body: ChatCompletionRequest, key: str = Depends(api_key)) -> dict:
        """vLLM's and llama-server's /tokenize, chat form: the prompt tokens the request would be computed on
        (chat template, tools and token-exact earlier calls included): what a client or a benchmark replays."""
        tokens = await chat_serving.tokenize(body, key)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    return router
