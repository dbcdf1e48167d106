"""OpenAI's chat and text completions API (anchor: vLLM entrypoints/openai/)."""

from kvserve.server.openai.router import openai_router

__all__ = ["openai_router"]
