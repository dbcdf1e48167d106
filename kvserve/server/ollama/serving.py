"""/api/chat and /api/generate: the prompt through the one prompt builder, the engine as for every API, and
Ollama's answer: one JSON object per line (NDJSON; `stream` defaults to true), the last with `done: true`,
`done_reason` and the counts and durations (nanoseconds) Ollama reports.

Tool calls go out whole (Ollama's `arguments` are an object), in the line before the last; with `think`,
a reasoning model's thinking goes in `message.thinking` (`thinking` for generate), apart from the answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone

from fastapi import Request as HTTPRequest

from kvserve.engine.output.types import RequestDelta, RequestOutput
from kvserve.errors import KVServeError
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job, OutputFormat
from kvserve.server.core.tenancy import tenant_id
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.ollama.protocol import ChatRequest, GenerateRequest, GenerationRequest, as_json_arguments, thinking_use
from kvserve.server.prompt.builder import Conversation
from kvserve.tools.parsing import ContentDelta, ToolCallParser
from kvserve.tools.reasoning import ReasoningParser
from kvserve.tools.rendering import Turn


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def chat(self, body: ChatRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        tool_use = serving.tool_use(body)
        reasoning = thinking_use(body.think, serving.chat_template, body.model)
        tenant = tenant_id(api_key)
        conversation = body.to_conversation(tool_use, tenant, reasoning.variables())
        job, reasoning = await serving.off_loop(self._job, body, conversation, tool_use, reasoning)
        fmt = OllamaFormat(serving, body, tool_use, tenant, chat=True, thinking=self._splitter(reasoning))
        return await serving.respond(fmt, [job], http, api_key, None, body.stream is not False)

    async def generate(self, body: GenerateRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        reasoning = thinking_use(body.think, serving.chat_template, body.model)
        if body.raw:  # the prompt as given, no template
            conversation = None
        else:
            system = [Turn("system", body.system)] if body.system else []
            conversation = Conversation(system + [Turn("user", body.prompt or "")], variables=reasoning.variables(),
                                        param="prompt")
        job, reasoning = await serving.off_loop(self._job, body, conversation, ToolUse(), reasoning)
        fmt = OllamaFormat(serving, body, ToolUse(), tenant_id(api_key), chat=False,
                           thinking=self._splitter(reasoning))
        return await serving.respond(fmt, [job], http, api_key, None, body.stream is not False)

    @staticmethod
    def _splitter(reasoning: ReasoningUse) -> ReasoningParser | None:
        """With thinking on, what splits it from the answer (the prompt may have opened it already)."""
        return reasoning.parser() if reasoning.enabled else None

    def _job(self, body: GenerationRequest, conversation: Conversation | None, tool_use: ToolUse,
             reasoning: ReasoningUse) -> tuple[Job, ReasoningUse]:
        """(worker) Build the prompt, validate."""
        serving = self.serving
        if conversation is None:
            token_ids = serving.prompts.encode_text(body.prompt or "", "prompt")
        else:
            token_ids = serving.prompts.build(conversation).token_ids
        body.note_num_ctx(serving.engine.max_model_len)
        room = max(serving.context_limit() - len(token_ids), 1)
        max_tokens = body.requested_max_tokens(room)
        if max_tokens is None:
            max_tokens = serving.default_max_tokens(len(token_ids))
        reasoning = reasoning.after_prompt(serving.tokenizer, token_ids)
        constraint = reasoning.gate(tool_use.constraint()) if reasoning.enabled else tool_use.constraint()
        params = serving.keep_markers(body.sampling(max_tokens, constraint), tool_use, reasoning)
        constraint_param = "tools" if tool_use.parses_calls else "format"
        return serving.jobs(0, token_ids, params, 1, 0, constraint_param=constraint_param)[0], reasoning


class OllamaFormat(OutputFormat):
    media_type = "application/x-ndjson"

    def __init__(self, serving: Serving, body: GenerationRequest, tool_use: ToolUse, tenant: str, chat: bool,
                 thinking: ReasoningParser | None) -> None:
        self.serving = serving
        self.body = body
        self.tenant = tenant
        self.chat = chat
        self.request_id = f"ollama-{uuid.uuid4().hex}"  # unique, as every API's
        self.parser: ToolCallParser | None = tool_use.parser()
        self.splitter = thinking
        self.started_ns = time.perf_counter_ns()

    # --- pieces ------------------------------------------------------------------------

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer text) of new output text."""
        if self.splitter is None:
            return "", text
        thinking, answer = self.splitter.feed(text)
        if finished:
            more_thinking, more_answer = self.splitter.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        return thinking, answer

    def _content(self, text: str, finished: bool) -> str:
        if self.parser is None:
            return text
        events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        return "".join(e.text for e in events if isinstance(e, ContentDelta))

    def _line(self, content: str, thinking: str, calls: list | None = None, done: dict | None = None) -> dict:
        line: dict = {"model": self.body.model, "created_at": now_iso()}
        if self.chat:
            message: dict = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            line["message"] = message
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        line["done"] = done is not None
        return {**line, **(done or {})}

    def _calls(self, output: RequestOutput | None = None) -> list[dict]:
        if self.parser is None:
            return []
        calls = self.parser.calls
        if output is not None:
            self.serving.count_tool_calls(len(calls))
        if calls and output is not None and output.outputs[0].finish_reason == "stop":
            completion = output.outputs[0]  # so the turn that sends these calls back holds their ids
            self.serving.answers.remember(self.tenant, calls[0].id, completion.text, completion.token_ids)
        parsed = [(c.name, as_json_arguments(c.arguments)) for c in calls]
        return [{"function": {"name": name, "arguments": arguments}} for name, arguments in parsed
                if arguments is not None]

    def _done(self, final: RequestOutput) -> dict:
        metrics, completion = final.metrics, final.outputs[0]
        end_ns = time.perf_counter_ns()
        first = metrics.first_token_time
        arrival_ns = int(metrics.arrival_time * 1e9)
        prompt_ns = int((first - metrics.arrival_time) * 1e9) if first is not None else end_ns - arrival_ns
        done = {"done_reason": "length" if completion.finish_reason == "length" else "stop",
                "total_duration": end_ns - self.started_ns, "load_duration": 0,
                "prompt_eval_count": len(final.prompt_token_ids) - final.num_cached_tokens,
                "prompt_eval_duration": prompt_ns, "eval_count": len(completion.token_ids),
                "eval_duration": max(end_ns - arrival_ns - prompt_ns, 0)}
        if not self.chat:
            done["context"] = []  # kvserve keeps the context in its prefix cache: resend the prompt
        return done

    # --- whole ---------------------------------------------------------------------------

    def response(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        final = finals.get(0)
        if final is None:  # the client left; nobody reads this
            return {"model": self.body.model, "done": False}
        thinking, text = self._split(final.outputs[0].text, True)
        return self._line(self._content(text, True), thinking, self._calls(final), self._done(final))

    # --- streamed ------------------------------------------------------------------------

    def output_events(self, job: Job, delta: RequestDelta) -> Iterable[str]:
        thinking, text = self._split(delta.new_text, delta.finished)
        content = self._content(text, delta.finished)
        if not content and not thinking:
            return ()
        return (_ndjson(self._line(content, thinking)),)

    def closing_events(self, jobs: list[Job], finals: dict[int, RequestOutput], error: KVServeError | None
                       ) -> Iterable[str]:
        final = finals.get(0)
        if error is not None or final is None:
            yield _ndjson({"error": str(error or "the request ended without an answer")})
            return
        calls = self._calls(final)
        if calls:
            yield _ndjson(self._line("", "", calls))
        yield _ndjson(self._line("", "", None, self._done(final)))


def _ndjson(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"
