"""OpenAI's Responses API: sessions that continue from exact token ids (`previous_response_id`)."""

from kvserve.server.responses.router import responses_router, responses_store

__all__ = ["responses_router", "responses_store"]
