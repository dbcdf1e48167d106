"""Routes of the session APIs: OpenAI Responses (/v1/responses) and Anthropic Messages (/v1/messages).

Kept apart from app.py so each API's module stays one job; the app installs
them with the same authentication dependency as every other route.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI, Query, Request

from kvserve.server.anthropic_protocol import MessagesRequest
from kvserve.server.errors import error_responses, unauthorized
from kvserve.server.messages import MessagesServing
from kvserve.server.responses import ResponsesServing
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.responses_store import ResponsesStore
from kvserve.server.serving import Serving


def install_session_routes(app: FastAPI, serving: Serving, api_key: Callable) -> None:
    settings = serving.settings
    # With a disk KV tier the stored responses persist beside its blocks (same model, same cache layout).
    state = serving.async_engine.engine.persistent_directory()
    store = ResponsesStore(settings.responses_store_max_count, settings.responses_store_max_bytes,
                           state / "responses" if state is not None else None)
    responses = ResponsesServing(serving, store)
    app.state.responses_store = store
    messages = MessagesServing(serving)

    async def anthropic_key(request: Request) -> str:
        """Anthropic's clients send `x-api-key`; a Bearer header works too. Both name the same tenants."""
        x_api_key = request.headers.get("x-api-key")
        key = serving.tenancy.authenticate(f"Bearer {x_api_key}" if x_api_key else request.headers.get("authorization"))
        if key is None:
            raise unauthorized()
        return key

    @app.post("/v1/messages", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
    async def create_message(body: MessagesRequest, request: Request, key: str = Depends(anthropic_key)):
        return await messages.create(body, request, key)

    @app.post("/v1/responses", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
    async def create_response(body: ResponsesRequest, request: Request, key: str = Depends(api_key)):
        return await responses.create(body, request, key)

    @app.get("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def get_response(response_id: str, key: str = Depends(api_key)) -> dict:
        return responses.get(response_id, key)

    @app.delete("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def delete_response(response_id: str, key: str = Depends(api_key)) -> dict:
        return responses.delete(response_id, key)

    @app.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404))
    async def response_input_items(response_id: str, key: str = Depends(api_key), limit: int = Query(20),
                                   order: str = Query("desc"), after: str | None = Query(None)) -> dict:
        return responses.input_items(response_id, key, limit, order, after)
