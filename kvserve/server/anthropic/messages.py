"""/v1/messages: Anthropic's Messages API, with cache_control breakpoints that really pin the prefix.

A breakpoint ends at a text block; the prompt builder (server/prompt/) says
where it falls in tokens (the tokens the text up to it shares with the whole
prompt: a token that straddles the boundary is not part of the prefix). Answers
that made tool calls are remembered, so a tool loop's next turn holds their
generated ids exactly (server/prompt/answers.py). The engine pins the
whole blocks up to each breakpoint for its TTL once the prompt is computed
(kv/prefix/pins.py). Usage is the cache's own accounting: `cache_read_input_tokens`
are the prompt tokens served from the prefix cache, `cache_creation_input_tokens`
the tokens this request wrote to the cache up to its last breakpoint
(kv/pins.cache_write_tokens), `input_tokens` the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from kvserve.engine.output.types import RequestDelta, RequestOutput
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.kv.prefix.pins import PinRequest, cache_write_tokens
from kvserve.server.anthropic.protocol import MessagesPrompt, MessagesRequest
from kvserve.server.anthropic.context_edits import ContextEdits, check_betas
from kvserve.server.anthropic.conversation import messages_conversation
from kvserve.server.anthropic.tool_blocks import BlockStream, output_blocks, thinking_block
from kvserve.server.compaction.summarizer import Summarizer, SummaryPass
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job, OutputFormat, sse_event
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.core.tool_use import ToolUse


class MessagesServing:
    def __init__(self, serving: Serving, summarizer: Summarizer | None = None) -> None:
        self.serving = serving
        self.summarizer = summarizer  # None: context_management compaction is refused

    async def create(self, body: MessagesRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        tool_use = serving.tool_use(body)
        reasoning = body.reasoning_use(serving.chat_template)
        tenant = tenant_id(api_key)
        applied, done = None, None
        if body.context_management is not None:
            check_betas(body.context_management.edits, http.headers.get("anthropic-beta"))
            edits = ContextEdits(serving.prompts)
            body, applied = await serving.off_loop(edits.clear_tool_uses, body, tool_use, tenant)
            edit = await serving.off_loop(edits.compaction_due, body, tool_use, tenant)
            if edit is not None:
                if self.summarizer is None:
                    raise InvalidRequestError("compaction is not served here", param="context_management")
                prompt = await serving.off_loop(edits.pass_prompt, body, tool_use, tenant, edit)
                done = await self.summarizer.run(prompt, tenant, serving.tenancy.cache_salt(api_key, None))
                if edit.pause_after_compaction:
                    return paused_after_compaction(body, done, applied, serving.settings.model_name)
                body = edits.compacted(body, done.summary)
        job, reasoning = await serving.off_loop(self._job, body, tool_use, tenant, reasoning)
        fmt = MessagesFormat(serving, body, job, tool_use, tenant, done, applied, reasoning)
        return await serving.respond(fmt, [job], http, api_key, None, body.stream)

    async def count_tokens(self, body: MessagesPrompt, api_key: str) -> dict:
        """/v1/messages/count_tokens: the prompt's tokens, exactly as /v1/messages would send them."""
        self.serving.check_model(body.model)
        body.check()
        tool_use = self.serving.tool_use(body)
        reasoning = body.reasoning_use(self.serving.chat_template)
        token_ids, _ = await self.serving.off_loop(self._render, body, tool_use, tenant_id(api_key), reasoning)
        return {"input_tokens": len(token_ids)}

    def _job(self, body: MessagesRequest, tool_use: ToolUse, tenant: str, reasoning: ReasoningUse
             ) -> tuple[Job, ReasoningUse]:
        """(worker) Render, tokenize, place the breakpoints, validate."""
        token_ids, pins = self._render(body, tool_use, tenant, reasoning)
        reasoning = reasoning.after_prompt(self.serving.tokenizer, token_ids)
        params = body.sampling_params(body.max_tokens, reasoning.gate(tool_use.constraint()))
        params = self.serving.keep_markers(params, tool_use, reasoning)
        job = self.serving.jobs(0, token_ids, params, 1, 0, constraint_param="tools")[0]
        job.pins = tuple(pins)
        return job, reasoning

    def _render(self, body: MessagesPrompt, tool_use: ToolUse, tenant: str, reasoning: ReasoningUse
                ) -> tuple[list[int], list[PinRequest]]:
        """(worker) The prompt's ids and its breakpoints (each mark's tag is its TTL)."""
        prompt = self.serving.prompts.build(messages_conversation(body, tool_use, tenant, reasoning.variables()))
        return prompt.token_ids, [PinRequest(num_tokens, ttl) for num_tokens, ttl in prompt.marks if num_tokens]


class MessagesFormat(OutputFormat):
    """Anthropic's Message object, and its stream (message_start ... message_stop)."""

    def __init__(self, serving: Serving, body: MessagesRequest, job: Job, tool_use: ToolUse, tenant: str,
                 compaction: SummaryPass | None = None, applied_edits: list[dict] | None = None,
                 reasoning: ReasoningUse | None = None) -> None:
        self.serving = serving
        self.compaction = compaction  # a pass that ran first: its block leads the content
        self.applied_edits = applied_edits  # None: no context_management asked for
        self.tenant = tenant
        self.body = body
        self.job = job
        self.reasoning = reasoning or ReasoningUse()
        self.thinker = self.reasoning.parser()  # None: the model does not reason
        parser = tool_use.parser()
        self.first_index = 1 if compaction is not None else 0  # of the answer's blocks
        # None: plain text, one text block opened at once; else blocks open as the output shows what they are
        self.blocks = BlockStream(self._event, parser, self.first_index) \
            if parser is not None or self.thinker is not None else None
        self.request_id = f"msg_{uuid.uuid4().hex}"
        self._started = False
        self._num_output_tokens = 0

    def _usage(self, num_cached_tokens: int, num_output_tokens: int) -> dict:
        engine = self.serving.engine
        breakpoint = max((pin.num_tokens for pin in self.job.pins), default=0)
        written = cache_write_tokens(breakpoint, num_cached_tokens, engine.config.block_size) \
            if engine.prefix_caching and breakpoint else 0
        ttl = max((pin for pin in self.job.pins if pin.num_tokens == breakpoint), key=lambda p: p.ttl_s,
                  default=None)
        long_lived = ttl is not None and ttl.ttl_s > 300
        return {
            "input_tokens": len(self.job.token_ids) - num_cached_tokens - written,
            "cache_creation_input_tokens": written, "cache_read_input_tokens": num_cached_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": 0 if long_lived else written,
                               "ephemeral_1h_input_tokens": written if long_lived else 0},
            "output_tokens": num_output_tokens, "service_tier": "standard",
        } | self._iterations(num_cached_tokens, num_output_tokens)

    def _iterations(self, num_cached_tokens: int, num_output_tokens: int) -> dict:
        """With a compaction pass: each pass's usage (the pass's not in the top-level fields, as Anthropic)."""
        if self.compaction is None:
            return {}
        top = {"input_tokens": len(self.job.token_ids) - num_cached_tokens, "cache_read_input_tokens":
               num_cached_tokens, "cache_creation_input_tokens": 0, "output_tokens": num_output_tokens}
        return {"iterations": [compaction_usage(self.compaction), {"type": "message", **top}]}

    def _stop(self, output: RequestOutput) -> tuple[str, str | None]:
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            return "max_tokens", None
        if self.blocks is not None and self.blocks.calls:
            return "tool_use", None
        tokenizer = self.serving.tokenizer
        if completion.finish_reason == "stop" and completion.token_ids and tokenizer is not None and \
                completion.token_ids[-1] not in tokenizer.stop_token_ids:
            whole = tokenizer.decode(completion.token_ids)  # the text before the stop sequence cut it
            for sequence in self.body.stop_sequences or []:
                if whole.startswith(sequence, len(completion.text)) or sequence in whole[len(completion.text):]:
                    return "stop_sequence", sequence
        return "end_turn", None

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        message = {"id": self.request_id, "type": "message", "role": "assistant", "model": self.body.model,
                   "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}
        if self.applied_edits is not None:
            message["context_management"] = {"applied_edits": self.applied_edits}
        return message

    def _remember(self, final: RequestOutput) -> None:
        """Keep an answer's generated ids for the turn that sends its tool_use blocks back (token-exact loops)."""
        completion = final.outputs[0]
        if self.blocks is not None and self.blocks.calls and completion.finish_reason == "stop":
            self.serving.answers.remember(self.tenant, self.blocks.calls[0].id, completion.text, completion.token_ids)

    def response(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        final = finals.get(0)
        if final is None:  # the client left; nobody reads this
            return self._message([], (None, None), self._usage(0, 0))
        completion = final.outputs[0]
        thinking, answer = self._split(completion.text, True)
        if self.blocks is None:
            content = [{"type": "text", "text": answer}]
        elif self.blocks.parser is None:
            content = [{"type": "text", "text": answer}] if answer else []
        else:
            content = output_blocks(answer, self.blocks.parser)
        if thinking:
            content.insert(0, thinking_block(thinking))
        if self.compaction is not None:
            content = [compaction_block(self.compaction), *content]
        self._remember(final)
        self.serving.count_tool_calls(sum(block["type"] == "tool_use" for block in content))
        return self._message(content, self._stop(final),
                             self._usage(final.num_cached_tokens, len(completion.token_ids)))

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) of new output text."""
        if self.thinker is None:
            return "", text
        thinking, answer = self.thinker.feed(text)
        if finished:
            more_thinking, more_answer = self.thinker.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        return thinking, answer

    # --- streaming -------------------------------------------------------------

    @staticmethod
    def _event(event_type: str, **fields) -> str:
        return sse_event({"type": event_type, **fields}, event=event_type)

    def _start(self, num_cached_tokens: int) -> list[str]:
        """message_start waits for the first delta: only then are the cache numbers known."""
        self._started = True
        start = [self._event("message_start", message=self._message([], (None, None),
                                                                      self._usage(num_cached_tokens, 0)))]
        if self.compaction is not None:  # the pass ran before the stream: its block, whole
            start += [self._event("content_block_start", index=0,
                                  content_block={"type": "compaction", "content": None}),
                      self._event("content_block_delta", index=0, delta={"type": "compaction_delta",
                                                                          "content": self.compaction.summary}),
                      self._event("content_block_stop", index=0)]
        if self.blocks is not None:  # blocks open as the output shows what they are
            return [*start, self._event("ping")]
        return [*start, self._event("content_block_start", index=self.first_index,
                                    content_block={"type": "text", "text": ""}), self._event("ping")]

    def output_events(self, job: Job, delta: RequestDelta) -> Iterable[str]:
        events = [] if self._started else self._start(delta.num_cached_tokens)
        if self.blocks is not None:
            thinking, answer = self._split(delta.new_text, delta.finished)
            return events + self.blocks.feed(answer, delta.finished, thinking)
        if delta.new_text:
            events.append(self._event("content_block_delta", index=self.first_index,
                                      delta={"type": "text_delta", "text": delta.new_text}))
        return events

    def closing_events(self, jobs: list[Job], finals: dict[int, RequestOutput], error: KVServeError | None
                       ) -> Iterable[str]:
        final = finals.get(0)
        if error is not None or final is None:
            kind = "invalid_request_error" if isinstance(error, InvalidRequestError) else "api_error"
            yield self._event("error", error={"type": kind,
                                              "message": str(error or "the request ended without an answer")})
            return
        if not self._started:
            yield from self._start(final.num_cached_tokens)
        self._remember(final)
        usage = self._usage(final.num_cached_tokens, len(final.outputs[0].token_ids))
        stop_reason, stop_sequence = self._stop(final)
        if self.blocks is not None:
            self.serving.count_tool_calls(len(self.blocks.calls))
        if self.blocks is None:  # (the blocks' own events closed them)
            yield self._event("content_block_stop", index=self.first_index)
        yield self._event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          usage=usage)
        yield self._event("message_stop")


def compaction_block(done: SummaryPass) -> dict:
    return {"type": "compaction", "content": done.summary}


def compaction_usage(done: SummaryPass) -> dict:
    return {"type": "compaction", "input_tokens": done.num_prompt_tokens - done.num_cached_tokens,
            "cache_read_input_tokens": done.num_cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": done.num_output_tokens}


def paused_after_compaction(body: MessagesRequest, done: SummaryPass, applied: list[dict] | None, model: str):
    """`pause_after_compaction`: the compaction block alone, stop_reason "compaction" (whole or streamed)."""
    usage = {"input_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0, "output_tokens": 0,
             "iterations": [compaction_usage(done)]}
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model or model,
               "content": [compaction_block(done)], "stop_reason": "compaction", "stop_sequence": None, "usage": usage}
    if applied is not None:
        message["context_management"] = {"applied_edits": applied}
    if not body.stream:
        return message
    event = MessagesFormat._event
    events = [event("message_start", message={**message, "content": [], "stop_reason": None}),
              event("content_block_start", index=0, content_block={"type": "compaction", "content": None}),
              event("content_block_delta", index=0, delta={"type": "compaction_delta", "content": done.summary}),
              event("content_block_stop", index=0),
              event("message_delta", delta={"stop_reason": "compaction", "stop_sequence": None}, usage=usage),
              event("message_stop")]
    return StreamingResponse(iter(events), media_type="text/event-stream")
