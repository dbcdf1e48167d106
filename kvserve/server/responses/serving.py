"""/v1/responses: OpenAI's Responses API with token-exact continuation (previous_response_id).

A follow-up's prompt is the previous response's exact token ids + the closing
of its answer + the new turn's tokens (server/prompt/segments.py), so it hits
every block the previous turn computed. A stateless follow-up (the items
resent) is built by the same prompt builder as every API, with the ids of the
answers that made tool calls spliced back (server/prompt/answers.py). `truncation="auto"` drops the oldest
turns (never the instructions, never the new turn) until the prompt and
`max_output_tokens` fit; "disabled" (the default) answers 400 with the counts.
A `prompt_cache_key` with `prompt_cache_retention` pins the whole prompt for
the retention's TTL (kv/prefix/pins.py). Stored responses live in
`ResponsesStore`, per tenant. Compaction (`/v1/responses/compact`, `context_management`) is
responses/compacting.py over server/compaction/; `conversation` is responses/conversations.py.
"""

from __future__ import annotations

from fastapi import Request as HTTPRequest

from kvserve.errors import InvalidRequestError
from kvserve.kv.prefix.pins import PinRequest
from kvserve.server.core.errors import APIError, bad_request
from kvserve.server.core.priority import request_priority
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.serving import Serving
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.prompt.segments import TurnSegments
from kvserve.server.responses.response_format import PreparedTurn, ResponsesFormat
from kvserve.server.responses.compacting import ResponsesCompaction
from kvserve.server.responses.conversations import ConversationsServing
from kvserve.server.responses.protocol import CompactRequest, ResponsesRequest, last_compaction
from kvserve.server.responses.store import ResponsesStore, StoredResponse
from kvserve.tools.rendering import Turn


def not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")


class ResponsesServing:
    def __init__(self, serving: Serving, store: ResponsesStore, compaction: ResponsesCompaction,
                 conversations: ConversationsServing) -> None:
        self.serving = serving
        self.store = store
        self.compaction = compaction
        self.conversations = conversations
        self._segments: TurnSegments | None = None

    @property
    def segments(self) -> TurnSegments:
        if self._segments is None:
            self._segments = TurnSegments(self.serving.prompts)
        return self._segments

    def _previous(self, body: ResponsesRequest, tenant: str) -> StoredResponse | None:
        if body.previous_response_id is None:
            return None
        previous = self.store.get(body.previous_response_id, tenant)
        if previous is None:  # another tenant's response reads exactly like one that never existed
            raise bad_request(f"Previous response with id '{body.previous_response_id}' not found.",
                              "previous_response_id")
        return previous

    async def create(self, body: ResponsesRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        tenant = tenant_id(api_key)
        previous = self._previous(body, tenant)
        on_finished = None
        if body.conversation_id is not None:
            body, previous, on_finished = self.conversations.continued(body, tenant)
        summary = self.compaction.summary_of(body, previous, tenant)
        if last_compaction(body.input)[0] is not None:
            previous = None  # the compaction item stands for everything before it, the stored turns included
        tool_use = serving.tool_use(body)
        reasoning = body.reasoning_use(serving.chat_template)
        prepared = await serving.off_loop(self._prepare, body, previous, tool_use, tenant, summary, None,
                                          reasoning)
        done = None
        if body.compact_threshold is not None and prepared.num_tokens > body.compact_threshold:
            found = await serving.off_loop(self.compaction.pass_prompt, body, previous, tool_use, tenant, summary,
                                           True, self.segments)
            if found is not None:  # else nothing but the new turn: nothing to fold
                done = await self.compaction.summarizer.run(found[0], tenant, serving.tenancy.cache_salt(api_key, None))
                prepared = await serving.off_loop(self._prepare, body, None, tool_use, tenant, done.summary,
                                                  found[1], reasoning)
        fmt = ResponsesFormat(serving, self.store, body, prepared, tenant, tool_use, done, on_finished)
        return await serving.respond(fmt, [prepared.job], http, api_key, None, body.stream,
                                     request_priority(body.priority, body.service_tier))

    async def compact(self, request: CompactRequest, api_key: str) -> dict:
        """POST /v1/responses/compact: the history's user messages, then one compaction item."""
        serving = self.serving
        serving.check_model(request.model)
        request.check()
        body, tenant = request.as_request(), tenant_id(api_key)
        previous = self._previous(body, tenant)
        summary = self.compaction.summary_of(body, previous, tenant)
        messages = self.compaction.user_messages(body, previous, tenant)
        if last_compaction(body.input)[0] is not None:
            previous = None
        tool_use = serving.tool_use(body)
        found = await serving.off_loop(self.compaction.pass_prompt, body, previous, tool_use, tenant, summary, False,
                                       self.segments)
        if found is None:
            raise bad_request("nothing to compact: the input has no messages", "input")
        done = await self.compaction.summarizer.run(found[0], tenant, serving.tenancy.cache_salt(api_key, None))
        return self.compaction.compacted(messages, done)

    def _prepare(self, body: ResponsesRequest, previous: StoredResponse | None, tool_use: ToolUse,
                 tenant: str, summary: str | None = None, turns: list[Turn] | None = None,
                 reasoning: ReasoningUse | None = None) -> PreparedTurn:
        """(worker) Render the new turn, continue the stored token ids, truncate, validate. Tools go into the
        instructions (kvserve's default block) or the template's `tools`, the same bytes every turn; a
        compacted history's `summary` follows the instructions there. `turns`: in place of the input's (what
        is left to answer after a compaction pass)."""
        serving, builder = self.serving, self.serving.prompts
        earlier = {item["call_id"]: item["name"] for item in (previous.body["output"] if previous else [])
                   if item["type"] == "function_call"}
        reasoning = reasoning or ReasoningUse()
        conversation = body.to_conversation(tool_use, tenant, earlier, summary, turns, reasoning.variables())
        if previous is None:
            prompt = builder.build(conversation)
            split = prompt.num_instruction_tokens
            instruction_ids, new_turn = prompt.token_ids[:split], prompt.token_ids[split:]
            turns: list[tuple[int, ...]] = []
        else:
            # OpenAI: a follow-up's instructions replace the previous ones (none: no system message).
            head = builder.instruction_messages(conversation)
            messages, variables = builder.messages(conversation)
            builder.check_chars(sum(len(m["content"]) for m in messages), "input")
            instruction_ids = self.segments.instructions(head[0]["content"] if head else None, variables)
            turns = list(previous.turns)
            turns[-1] = turns[-1] + tuple(self.segments.close_answer(turns[-1]))
            new_turn = self.segments.next_turn(messages[len(head):], variables)
        limit = serving.context_limit()
        reserve = body.max_output_tokens or 1

        def prompt_len() -> int:
            return len(instruction_ids) + sum(len(t) for t in turns) + len(new_turn)

        num_dropped = 0
        if prompt_len() + reserve > limit and body.truncation == "auto":
            while turns and prompt_len() + reserve > limit:
                turns.pop(0)  # the rolling window: the oldest turn goes first; the instructions stay
                num_dropped += 1
        if prompt_len() + reserve > limit:
            what = "even after dropping every earlier turn (truncation='auto')" if body.truncation == "auto" else (
                "; truncation='auto' drops the oldest turns until it fits")
            raise InvalidRequestError(
                f"the input is {prompt_len()} tokens (instructions {len(instruction_ids)}, earlier turns "
                f"{sum(len(t) for t in turns)}, this turn {len(new_turn)}) and max_output_tokens {reserve}: more than "
                f"the context of {limit} tokens {what}", param="input")
        prompt = [t for segment in (instruction_ids, *turns, new_turn) for t in segment]
        max_tokens = body.max_output_tokens if body.max_output_tokens is not None else \
            serving.default_max_tokens(len(prompt))
        reasoning = reasoning.after_prompt(serving.tokenizer, prompt)
        params = serving.keep_markers(body.sampling_params(max_tokens, tool_use, reasoning), tool_use, reasoning)
        job = serving.jobs(0, prompt, params, 1, 0, constraint_param=tool_use.constraint_param)[0]
        if body.pin_ttl_s is not None:
            job.pins = (PinRequest(len(prompt), body.pin_ttl_s),)
        return PreparedTurn(tuple(instruction_ids), tuple(turns), tuple(new_turn), job, num_dropped, summary, reasoning)

    def get(self, response_id: str, api_key: str) -> dict:
        entry = self.store.get(response_id, tenant_id(api_key))
        if entry is None:
            raise not_found(response_id)
        return entry.body

    def delete(self, response_id: str, api_key: str) -> dict:
        if not self.store.delete(response_id, tenant_id(api_key)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, api_key: str, limit: int, order: str, after: str | None) -> dict:
        entry = self.store.get(response_id, tenant_id(api_key))
        if entry is None:
            raise not_found(response_id)
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
        items = list(entry.input_items) if order == "asc" else list(reversed(entry.input_items))
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"no input item with id '{after}' in this response", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
