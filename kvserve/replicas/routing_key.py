"""A request's leading block hashes as its replica will compute them, before it is routed.

The ingress tokenizes the prompt the way the server does (the model's
tokenizer; chat messages through its chat template) and hashes it with
kvserve's stable block hashes under the tenant's salt (the API key's, as
server/core/tenancy.py derives it, with the client's `cache_salt` mixed in),
then converts them to the external hashes the replicas report
(kv/event_wire.py). Exact for /v1/completions and for chat messages of plain
text; Anthropic's /v1/messages and /v1/responses are rendered as chat
messages (system or instructions first), which matches their leading blocks
where the server renders them alike. Anything it cannot read routes by load
alone: the replica answers it (a 400 or 401 comes from the server itself).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvserve.kv.event_wire import external_block_hash
from kvserve.kv.hashing import block_hashes
from kvserve.server.core.tenancy import Tenancy

MAX_ROUTING_BLOCKS = 256  # a prefix this long decides the route; hashing more costs the ingress for nothing


class RoutingKeys:
    def __init__(self, tokenizer, block_size: int, api_keys: list[str]) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.tenancy = Tenancy(api_keys)

    def hashes(self, path: str, headers: Mapping[str, str], body: bytes) -> list[int]:
        """The request's leading block hashes, or [] if it has none to route by."""
        try:
            request = json.loads(body) if body else None
            if not isinstance(request, dict):
                return []
            x_api_key = headers.get("x-api-key") if path == "/v1/messages" else None
            key = self.tenancy.authenticate(f"Bearer {x_api_key}" if x_api_key else headers.get("authorization"))
            tokens = self._tokens(path, request) if self.tokenizer is not None else []
        except (ValueError, TypeError, KeyError):
            return []
        if key is None or not tokens:
            return []
        client_salt = request.get("cache_salt")
        salt = self.tenancy.cache_salt(key, client_salt if isinstance(client_salt, str) else None)
        chain = block_hashes(tokens[: MAX_ROUTING_BLOCKS * self.block_size], self.block_size, salt)
        return [external_block_hash(h) for h in chain.hashes]

    def _tokens(self, path: str, request: dict[str, Any]) -> list[int]:
        if path == "/v1/completions":
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else []
        messages: list[dict[str, Any]] = []
        if path == "/v1/chat/completions":
            messages = request.get("messages") or []
        elif path == "/v1/messages":
            system = request.get("system")
            messages = ([{"role": "system", "content": system}] if isinstance(system, str) else []) + \
                (request.get("messages") or [])
        elif path == "/v1/responses":
            instructions, given = request.get("instructions"), request.get("input")
            messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
            messages += [{"role": "user", "content": given}] if isinstance(given, str) else []
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return []
        return self.tokenizer.encode_chat([{"role": m.get("role", "user"), "content": m["content"]}
                                           for m in messages], True)
