"""/v1/chat/completions: messages rendered by the model's chat template, `n` choices, a reasoning model's
thinking apart from its answer (`reasoning_content`, vLLM's name, in the message and the stream's deltas), tool
calls parsed out of the answer (whole, or as `delta.tool_calls` fragments while streaming)."""

from __future__ import annotations

from fastapi import Request as HTTPRequest

from kvserve.engine.output.types import RequestDelta, RequestOutput, TokenLogprob
from kvserve.errors import KVServeError
from kvserve.server.core.reasoning_use import ReasoningUse, reasoning_tokens
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.openai.format import OpenAIFormat
from kvserve.server.openai.protocol import ChatCompletionRequest
from kvserve.tools.parsing import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser
from kvserve.tools.reasoning import ReasoningParser


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: ChatCompletionRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        tool_use = serving.tool_use(body)
        reasoning = body.reasoning_use(serving.chat_template)
        serving.check_batch_size(body.n, "n")
        tenant = tenant_id(api_key)
        jobs, reasoning = await serving.off_loop(self._jobs, body, tool_use, tenant, reasoning)
        fmt = ChatFormat(serving, body.include_usage, body.prompt_logprobs is not None, tool_use, tenant, reasoning)
        return await serving.respond(fmt, jobs, http, api_key, body.cache_salt, body.stream,
                                     body.scheduling_priority)

    async def tokenize(self, body: ChatCompletionRequest, api_key: str) -> list[int]:
        """The prompt tokens a chat request would be computed on (/tokenize), tools and spliced calls included."""
        self.serving.check_model(body.model)
        reasoning = body.reasoning_use(self.serving.chat_template)
        return await self.serving.off_loop(self.render, body, self.serving.tool_use(body), tenant_id(api_key),
                                           reasoning)

    def render(self, body: ChatCompletionRequest, tool_use: ToolUse, tenant: str, reasoning: ReasoningUse
               ) -> list[int]:
        """(worker) The conversation's prompt tokens (server/prompt/): answers that made tool calls keep the ids
        they were generated as."""
        return self.serving.prompts.build(body.to_conversation(tool_use, tenant, reasoning.variables())).token_ids

    def _jobs(self, body: ChatCompletionRequest, tool_use: ToolUse, tenant: str, reasoning: ReasoningUse
              ) -> tuple[list[Job], ReasoningUse]:
        """(worker) Render, tokenize and validate the conversation."""
        serving = self.serving
        token_ids = self.render(body, tool_use, tenant, reasoning)
        reasoning = reasoning.after_prompt(serving.tokenizer, token_ids)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = serving.default_max_tokens(len(token_ids))
        params = serving.keep_markers(body.sampling_params(max_tokens, tool_use, reasoning), tool_use, reasoning)
        return serving.jobs(0, token_ids, params, body.n, 0, constraint_param=tool_use.constraint_param), reasoning


def tool_call_entries(events: list) -> list[dict]:
    """One chunk's `delta.tool_calls`: one entry per call index, as OpenAI sends them (a call's id and name
    with the first fragment of its arguments, the fragments of one chunk joined). Two entries with the same
    index in one chunk corrupt the arguments in the openai SDK's stream helper (1.x, 2.x)."""
    entries: dict[int, dict] = {}
    for event in events:
        if isinstance(event, CallStarted):
            entries[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}
        elif isinstance(event, ArgumentsDelta):
            entry = entries.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += event.fragment
    return list(entries.values())


def _finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


class ChatFormat(OpenAIFormat):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, serving: Serving, include_usage: bool = False, prompt_logprobs: bool = False,
                 tool_use: ToolUse | None = None, tenant: str = "", reasoning: ReasoningUse | None = None) -> None:
        super().__init__(serving, include_usage, prompt_logprobs)
        self.tool_use = tool_use or ToolUse()
        self.tenant = tenant
        self.reasoning = reasoning or ReasoningUse()
        self._parsers: dict[int, ToolCallParser] = {}
        self._thinkers: dict[int, ReasoningParser] = {}
        self._thinking: dict[int, list[str]] = {}  # each choice's thinking so far (for usage)

    def _split(self, job: Job, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) of a choice's new text; all answer for a model that does not reason."""
        if not self.reasoning.active:
            return "", text
        thinker = self._thinkers.setdefault(job.index, self.reasoning.parser())
        thinking, answer = thinker.feed(text)
        if finished:
            more_thinking, more_answer = thinker.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        self._thinking.setdefault(job.index, []).append(thinking)
        return thinking, answer

    def usage(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        usage = super().usage(jobs, finals)
        if self.reasoning.active:
            thinking = sum(reasoning_tokens(self.serving.tokenizer, "".join(parts)) for parts in self._thinking.values())
            usage["completion_tokens_details"] = {**usage.get("completion_tokens_details", {}),
                                                  "reasoning_tokens": thinking}
        return usage

    def _remember(self, calls: list, output: RequestOutput) -> None:
        """Keep an answer's generated ids for the turn that sends it back (token-exact tool loops)."""
        completion = output.outputs[0]
        if calls and completion.finish_reason == "stop":
            self.serving.answers.remember(self.tenant, calls[0].id, completion.text, completion.token_ids)

    def final_choice(self, job: Job, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        thinking, answer = self._split(job, completion.text, True)
        message: dict = {"role": "assistant", "content": answer}
        if self.reasoning.active:
            message["reasoning_content"] = thinking or None
        calls = []
        if self.tool_use.parses_calls:
            parsed = self.tool_use.parser().parse(answer)
            calls = parsed.calls
            self.serving.count_tool_calls(len(calls))
            self._remember(calls, output)
            message["content"] = parsed.content or None if calls else parsed.content
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return {
            "index": job.index, "message": message, "logprobs": self._logprobs(completion.logprobs),
            "finish_reason": _finish_reason(completion.finish_reason, bool(calls)),
        }

    def closing_events(self, jobs, finals, error: KVServeError | None):
        for job in jobs:
            if job.index in self._parsers and job.index in finals:
                self._remember(self._parsers[job.index].calls, finals[job.index])
                self.serving.count_tool_calls(len(self._parsers[job.index].calls))
        return super().closing_events(jobs, finals, error)

    def opening_chunks(self, jobs):
        # OpenAI's first chunk of each choice carries only the role.
        return [self.envelope([{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], stream=True) for job in jobs]

    def chunk(self, job: Job, delta: RequestDelta) -> dict | None:
        if not delta.new_text and not delta.finished and not delta.new_logprobs:
            return None
        thinking, answer = self._split(job, delta.new_text, delta.finished)
        if self.tool_use.parses_calls:
            content, finish_reason = self._tool_delta(job, answer, delta)
        else:
            content = {"content": answer} if answer or not (delta.finished or self.reasoning.active) else {}
            finish_reason = delta.finish_reason
        if thinking:
            content = {"reasoning_content": thinking, **content}
        if not content and not delta.finished and not delta.new_logprobs:
            return None  # held back: it may be the start of a call
        return self.envelope([{
            "index": job.index, "delta": content, "logprobs": self._logprobs(delta.new_logprobs),
            "finish_reason": finish_reason if delta.finished else None,
        }], stream=True)

    def _tool_delta(self, job: Job, answer: str, delta: RequestDelta) -> tuple[dict, str | None]:
        """The delta of a choice whose output may hold calls: content, and `tool_calls` entries by index
        (the first of a call with its id and name, then argument fragments), as the openai client merges them."""
        parser = self._parsers.setdefault(job.index, self.tool_use.parser())
        events = parser.feed(answer)
        if delta.finished:
            events += parser.finish()
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        content: dict = {"content": text} if text else {}
        calls = tool_call_entries(events)
        if calls:
            content["tool_calls"] = calls
        return content, _finish_reason(delta.finish_reason, bool(parser.calls))

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        token_text = self.serving.token_text

        def item(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ]}
