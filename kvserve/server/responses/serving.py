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
`ResponsesStore`, per tenant.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from kvserve.engine.output.types import RequestDelta, RequestOutput
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.kv.prefix.pins import PinRequest
from kvserve.server.core.errors import APIError, bad_request, internal
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job, OutputFormat, sse_event
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.prompt.segments import TurnSegments
from kvserve.server.responses.output_items import OutputItems
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.store import ResponsesStore, StoredResponse


def not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")


@dataclass
class PreparedTurn:
    """A request's conversation as token segments, and the job that generates its answer."""

    instruction_ids: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]  # the earlier turns kept (after truncation), the last one closed
    new_turn: tuple[int, ...]  # this turn's messages + generation prompt
    job: Job
    num_dropped_turns: int = 0


class ResponsesServing:
    def __init__(self, serving: Serving, store: ResponsesStore) -> None:
        self.serving = serving
        self.store = store
        self._segments: TurnSegments | None = None

    @property
    def segments(self) -> TurnSegments:
        if self._segments is None:
            self._segments = TurnSegments(self.serving.prompts)
        return self._segments

    async def create(self, body: ResponsesRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        tenant = tenant_id(api_key)
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, tenant)
            if previous is None:  # another tenant's response reads exactly like one that never existed
                raise bad_request(f"Previous response with id '{body.previous_response_id}' not found.",
                                  "previous_response_id")
        tool_use = serving.tool_use(body)
        prepared = await serving.off_loop(self._prepare, body, previous, tool_use, tenant)
        fmt = ResponsesFormat(serving, self.store, body, prepared, tenant, tool_use)
        return await serving.respond(fmt, [prepared.job], http, api_key, None, body.stream)

    def _prepare(self, body: ResponsesRequest, previous: StoredResponse | None, tool_use: ToolUse,
                 tenant: str) -> PreparedTurn:
        """(worker) Render the new turn, continue the stored token ids, truncate, validate. Tools go into the
        instructions (kvserve's default block) or the template's `tools`, the same bytes every turn."""
        serving, builder = self.serving, self.serving.prompts
        earlier = {item["call_id"]: item["name"] for item in (previous.body["output"] if previous else [])
                   if item["type"] == "function_call"}
        conversation = body.to_conversation(tool_use, tenant, earlier)
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
        job = serving.jobs(0, prompt, body.sampling_params(max_tokens, tool_use), 1, 0,
                           constraint_param=tool_use.constraint_param)[0]
        if body.pin_ttl_s is not None:
            job.pins = (PinRequest(len(prompt), body.pin_ttl_s),)
        return PreparedTurn(tuple(instruction_ids), tuple(turns), tuple(new_turn), job, num_dropped)

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


class ResponsesFormat(OutputFormat):
    """The Response object, and OpenAI's stream of typed events (`event:` + `data:` with `type`)."""

    def __init__(self, serving: Serving, store: ResponsesStore, body: ResponsesRequest, prepared: PreparedTurn,
                 tenant: str, tool_use: ToolUse) -> None:
        self.serving = serving
        self.store = store
        self.body = body
        self.prepared = prepared
        self.tenant = tenant
        self.request_id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._sequence = 0
        self._text: list[str] = []
        parser = tool_use.parser()  # None: plain text, one message item opened at once
        self.items = OutputItems(self._event, parser) if parser is not None else None

    # --- the Response object -------------------------------------------------

    def _message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
            else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _object(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None,
                error: dict | None = None) -> dict:
        body = self.body
        return {
            "id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.serving.settings.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else
            body.tool_choice or ("auto" if body.tools else "none"), "tools": [t.model_dump() for t in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
        }

    def _final(self, final: RequestOutput) -> dict:
        completion = final.outputs[0]
        status, incomplete = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens")}.get(
            completion.finish_reason or "", ("cancelled", None))
        usage = {
            "input_tokens": len(final.prompt_token_ids),
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": len(completion.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(final.prompt_token_ids) + len(completion.token_ids),
        }
        item_status = "completed" if status == "completed" else "incomplete"
        if self.items is None:
            output = [self._message(completion.text, item_status)]
        else:
            if not self.items.finished:  # not streamed: the whole text at once
                self.items.feed(completion.text, True)
            output = self.items.final(item_status)
            calls = self.items.parser.calls
            self.serving.count_tool_calls(len(calls))
            if calls and completion.finish_reason == "stop":  # for the turn that resends its calls as items
                self.serving.answers.remember(self.tenant, calls[0].id, completion.text, completion.token_ids)
        body = self._object(status, output, usage, incomplete)
        if self.body.store and status != "cancelled":
            self._store(body, completion.token_ids)
        return body

    def _store(self, body: dict, output_ids: list[int]) -> None:
        prepared = self.prepared
        items = tuple({"id": f"msg_{uuid.uuid4().hex}", **item} for item in self.body.input_items())
        self.store.put(StoredResponse(
            self.request_id, self.tenant, body, items, self.body.instructions, prepared.instruction_ids,
            prepared.turns + (prepared.new_turn + tuple(output_ids),)))

    def response(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        final = finals.get(0)
        if final is None:  # the client left; nobody reads this
            return self._object("cancelled", [], None)
        return self._final(final)

    # --- streaming -----------------------------------------------------------

    def _event(self, event_type: str, **fields) -> str:
        payload = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(payload, event=event_type)

    def opening_events(self, jobs: list[Job]) -> Iterable[str]:
        in_progress = self._object("in_progress", [], None)
        opening = [self._event("response.created", response=in_progress),
                   self._event("response.in_progress", response=in_progress)]
        if self.items is not None:  # items open as the output shows what they are
            return opening
        return [
            *opening,
            self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
            self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
        ]

    def output_events(self, job: Job, delta: RequestDelta) -> Iterable[str]:
        if self.items is not None:
            return self.items.feed(delta.new_text, delta.finished,
                                   "completed" if delta.finish_reason == "stop" else "incomplete")
        if not delta.new_text:
            return ()
        self._text.append(delta.new_text)
        return (self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                            delta=delta.new_text, logprobs=[]),)

    def closing_events(self, jobs: list[Job], finals: dict[int, RequestOutput], error: KVServeError | None
                       ) -> Iterable[str]:
        final = finals.get(0)
        if error is not None or final is None:
            api_error = bad_request(str(error), getattr(error, "param", None)) if isinstance(
                error, InvalidRequestError) else internal(str(error or "the request ended without an answer"))
            detail = api_error.body()["error"]
            yield self._event("error", code=detail["code"], message=detail["message"], param=detail["param"])
            yield self._event("response.failed", response=self._object(
                "failed", [], None, error={"code": "server_error", "message": detail["message"]}))
            return
        body = self._final(final)
        if self.items is not None:  # the items' own events closed them
            yield self._event("response.completed" if body["status"] == "completed" else "response.incomplete",
                              response=body)
            return
        text = "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                          text=text, logprobs=[])
        yield self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                          part=part)
        yield self._event("response.output_item.done", output_index=0, item=body["output"][0])
        yield self._event("response.completed" if body["status"] == "completed" else "response.incomplete",
                          response=body)
