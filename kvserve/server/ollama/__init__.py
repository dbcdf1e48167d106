"""Ollama's API (/api/*), beside the OpenAI, Responses and Anthropic ones, over the same engine, tenants and cache.

- protocol.py  its request shapes (its own field names), `options` onto SamplingParams, messages into the
               prompt builder's conversation (Ollama's calls carry no ids: each gets one from its content)
- serving.py   /api/chat and /api/generate: NDJSON lines, durations in nanoseconds, the last line `done`
- router.py    the routes, the model's description (/api/tags, /api/show, /api/ps), and the refusals of
               what kvserve does not do (pull, push, create, copy, delete, embeddings)
"""

from kvserve.server.ollama.router import ollama_router

__all__ = ["ollama_router"]
