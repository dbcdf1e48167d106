"""The Response object and OpenAI's stream of typed events for one /v1/responses request.

A compaction pass that ran first (context_management) leads the output with its compaction item (and the
stream with `response.output_item.added`, `response.compaction.compacting`, `response.output_item.done` for
it), and its tokens count in `usage`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.engine.output.types import RequestDelta, RequestOutput
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.server.compaction.summarizer import SummaryPass
from kvserve.server.core.errors import bad_request, internal
from kvserve.server.core.reasoning_use import ReasoningUse, reasoning_tokens
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job, OutputFormat, sse_event
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.responses.compacting import pass_usage
from kvserve.server.responses.output_items import OutputItems
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.store import ResponsesStore, StoredResponse


@dataclass
class PreparedTurn:
    """A request's conversation as token segments, and the job that generates its answer."""

    instruction_ids: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]  # the earlier turns kept (after truncation), the last one closed
    new_turn: tuple[int, ...]  # this turn's messages + generation prompt
    job: Job
    num_dropped_turns: int = 0
    summary: str | None = None  # of the compacted history the instructions segment carries
    reasoning: ReasoningUse = field(default_factory=ReasoningUse)  # as the prompt left it (opened, closed)

    @property
    def num_tokens(self) -> int:
        return len(self.job.token_ids)


class ResponsesFormat(OutputFormat):
    """The Response object, and OpenAI's stream of typed events (`event:` + `data:` with `type`)."""

    def __init__(self, serving: Serving, store: ResponsesStore, body: ResponsesRequest, prepared: PreparedTurn,
                 tenant: str, tool_use: ToolUse, compaction: SummaryPass | None = None,
                 on_finished: Callable[[StoredResponse], None] | None = None) -> None:
        self.serving = serving
        self.compaction = compaction  # the pass that ran first, if any: its item leads the output
        self.on_finished = on_finished  # a conversation's: takes the turn's items and token ids
        self.store = store
        self.body = body
        self.prepared = prepared
        self.tenant = tenant
        self.request_id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._sequence = 0
        self._text: list[str] = []
        self.thinker = prepared.reasoning.parser()  # None: the model does not reason
        self._thinking: list[str] = []
        parser = tool_use.parser()
        self.first_index = 1 if compaction is not None else 0  # of the answer's items in `output`
        # None: plain text, one message item opened at once; else items open as the output shows what they are
        self.items = OutputItems(self._event, parser, self.first_index) \
            if parser is not None or self.thinker is not None else None

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) of new output text."""
        if self.thinker is None:
            return "", text
        thinking, answer = self.thinker.feed(text)
        if finished:
            more_thinking, more_answer = self.thinker.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        self._thinking.append(thinking)
        return thinking, answer

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
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store, "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else
            body.tool_choice or ("auto" if body.tools else "none"), "tools": [t.model_dump() for t in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
            "conversation": {"id": body.conversation_id} if body.conversation_id is not None else None,
        }

    def _final(self, final: RequestOutput) -> dict:
        completion = final.outputs[0]
        status, incomplete = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens")}.get(
            completion.finish_reason or "", ("cancelled", None))
        item_status = "completed" if status == "completed" else "incomplete"
        if self.items is None:
            output = [self._message(completion.text, item_status)]
        else:
            if not self.items.finished:  # not streamed: the whole text at once
                thinking, answer = self._split(completion.text, True)
                self.items.feed(answer, True, thinking=thinking)
            output = self.items.final(item_status)
            calls = self.items.calls
            self.serving.count_tool_calls(len(calls))
            if calls and completion.finish_reason == "stop":  # for the turn that resends its calls as items
                self.serving.answers.remember(self.tenant, calls[0].id, completion.text, completion.token_ids)
        reasoning = reasoning_tokens(self.serving.tokenizer, "".join(self._thinking))
        usage = {
            "input_tokens": len(final.prompt_token_ids),
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": len(completion.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": len(final.prompt_token_ids) + len(completion.token_ids),
        }
        if self.compaction is not None:  # the pass counts: its prompt and its summary
            spent = pass_usage(self.compaction)
            usage = {"input_tokens": usage["input_tokens"] + spent["input_tokens"],
                     "input_tokens_details": {
                         "cached_tokens": final.num_cached_tokens + self.compaction.num_cached_tokens},
                     "output_tokens": usage["output_tokens"] + spent["output_tokens"],
                     "output_tokens_details": {"reasoning_tokens": reasoning},
                     "total_tokens": usage["total_tokens"] + spent["total_tokens"]}
        if self.compaction is not None:
            output = [self.compaction.item, *output]
        body = self._object(status, output, usage, incomplete)
        if status != "cancelled":
            self._store(body, completion.token_ids)
        return body

    def _store(self, body: dict, output_ids: list[int]) -> None:
        prepared = self.prepared
        items = tuple({"id": f"msg_{uuid.uuid4().hex}", **item} for item in self.body.input_items())
        entry = StoredResponse(self.request_id, self.tenant, body, items, self.body.instructions,
                               prepared.instruction_ids, prepared.turns + (prepared.new_turn + tuple(output_ids),),
                               prepared.summary)
        if self.body.store:
            self.store.put(entry)
        if self.on_finished is not None:
            self.on_finished(entry)

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
        if self.compaction is not None:  # the pass ran before the stream opened: its item, whole
            item = self.compaction.item
            opening += [self._event("response.output_item.added", output_index=0, item=item),
                        self._event("response.compaction.compacting", item_id=item["id"], output_index=0),
                        self._event("response.output_item.done", output_index=0, item=item)]
        if self.items is not None:  # items open as the output shows what they are
            return opening
        return [
            *opening,
            self._event("response.output_item.added", output_index=self.first_index,
                        item=self._message("", "in_progress")),
            self._event("response.content_part.added", item_id=self.item_id, output_index=self.first_index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
        ]

    def output_events(self, job: Job, delta: RequestDelta) -> Iterable[str]:
        if self.items is not None:
            thinking, answer = self._split(delta.new_text, delta.finished)
            return self.items.feed(answer, delta.finished,
                                   "completed" if delta.finish_reason == "stop" else "incomplete", thinking)
        if not delta.new_text:
            return ()
        self._text.append(delta.new_text)
        return (self._event("response.output_text.delta", item_id=self.item_id, output_index=self.first_index,
                            content_index=0,
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
        yield self._event("response.output_text.done", item_id=self.item_id, output_index=self.first_index,
                          content_index=0,
                          text=text, logprobs=[])
        yield self._event("response.content_part.done", item_id=self.item_id, output_index=self.first_index,
                          content_index=0,
                          part=part)
        yield self._event("response.output_item.done", output_index=self.first_index,
                          item=body["output"][self.first_index])
        yield self._event("response.completed" if body["status"] == "completed" else "response.incomplete",
                          response=body)
