"""A request's leading block hashes as its replica will compute them, before it is routed.

The ingress reads the body with the API's own request model and builds the prompt with the server's
own prompt builder (server/prompt/): the same turns, tools, template and spliced answers, so the
hashes equal the replica's block hashes by construction. The answers that made tool calls are the
replicas' (each forwards what it remembers after a response, replicas/engine_replica.py), kept here per
tenant as a replica keeps them. The hashes are kvserve's stable block hashes under the tenant's salt
(the API key's, as server/core/tenancy.py derives it, with the client's `cache_salt` mixed in),
converted to the external hashes the replicas report (kv/events/wire.py).

A Responses request continued by `previous_response_id` is routed by load: the ingress has no store
of responses. So is anything it cannot read: the replica answers it (a 400 or 401 comes from the server
itself).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from pydantic import ValidationError

from kvserve.errors import KVServeError
from kvserve.kv.events.wire import external_block_hash
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.server.anthropic.conversation import messages_conversation
from kvserve.server.anthropic.protocol import MessagesPrompt
from kvserve.server.core.tenancy import Tenancy, tenant_id
from kvserve.server.openai.protocol import ChatCompletionRequest
from kvserve.server.prompt.answers import GeneratedAnswers, RememberedAnswer
from kvserve.server.prompt.builder import PromptBuilder
from kvserve.server.responses.protocol import ResponsesRequest, last_compaction

MAX_ROUTING_BLOCKS = 256  # a prefix this long decides the route; hashing more costs the ingress for nothing


class RoutingKeys:
    def __init__(self, tokenizer, block_size: int, api_keys: list[str]) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.tenancy = Tenancy(api_keys)
        self.answers = GeneratedAnswers()
        self.prompts = PromptBuilder(tokenizer, self.answers) if tokenizer is not None else None

    def remember(self, answers: list[RememberedAnswer]) -> None:
        """Answers a replica remembered (forwarded after a response)."""
        for answer in answers:
            self.answers.remember(answer.tenant, answer.call_id, answer.text, answer.token_ids)

    def hashes(self, path: str, headers: Mapping[str, str], body: bytes) -> list[int]:
        """The request's leading block hashes, or [] if it has none to route by."""
        try:
            request = json.loads(body) if body else None
            if not isinstance(request, dict):
                return []
            x_api_key = headers.get("x-api-key") if path == "/v1/messages" else None
            key = self.tenancy.authenticate(f"Bearer {x_api_key}" if x_api_key else headers.get("authorization"))
            if key is None or self.prompts is None:
                return []
            tokens = self._tokens(path, request, tenant_id(key))
        except (ValueError, TypeError, KeyError, ValidationError, KVServeError):
            return []
        if not tokens:
            return []
        client_salt = request.get("cache_salt")
        salt = self.tenancy.cache_salt(key, client_salt if isinstance(client_salt, str) else None)
        chain = block_hashes(tokens[: MAX_ROUTING_BLOCKS * self.block_size], self.block_size, salt)
        return [external_block_hash(h) for h in chain.hashes]

    def _tokens(self, path: str, request: dict[str, Any], tenant: str) -> list[int]:
        if path == "/v1/completions":
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            return self.prompts.encode_text(prompt) if isinstance(prompt, str) else []
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(request)
            template = self.prompts.tokenizer.chat_template
            conversation = chat.to_conversation(chat.tool_use(), tenant, chat.reasoning_use(template).variables())
        elif path == "/v1/messages":
            messages = MessagesPrompt.model_validate(request)
            reasoning = messages.reasoning_use(self.prompts.tokenizer.chat_template)
            conversation = messages_conversation(messages, messages.tool_use(), tenant, reasoning.variables())
        elif path == "/v1/responses":
            responses = ResponsesRequest.model_validate(request)
            if responses.previous_response_id is not None or responses.conversation is not None or \
                    last_compaction(responses.input)[0] is not None:
                return []  # a stored or sealed history the ingress cannot render: the replicas hold it
            reasoning = responses.reasoning_use(self.prompts.tokenizer.chat_template)
            conversation = responses.to_conversation(responses.tool_use(), tenant, None, None, None,
                                                     reasoning.variables())
        else:
            return []
        return self.prompts.build(conversation).token_ids
