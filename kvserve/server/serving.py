"""/v1/completions and /v1/chat/completions on top of the AsyncEngine.

A request becomes one engine request per (prompt, choice): `n` choices of a
prompt run side by side and share the prompt's KV blocks through the prefix
cache. Outputs come back as one JSON body, or as Server-Sent Events with one
chunk per engine step and `data: [DONE]` at the end. A client that goes away
(disconnect mid-stream, or while a non-streaming request runs) aborts every
engine request it started, which frees their blocks.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import lru_cache

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.output import RequestOutput, TokenLogprob
from kvserve.engine.sampling import SamplingParams
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.server.errors import bad_request, model_not_found, overloaded
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.tenancy import Tenancy

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


@dataclass
class ServerSettings:
    model_name: str
    api_keys: list[str] = field(default_factory=list)
    max_waiting_requests: int = 256  # past this, new requests get 429 at once
    log_prompts: bool = False


@dataclass
class _Job:
    """One engine request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    token_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, settings: ServerSettings) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.settings = settings
        self.tenancy = Tenancy(settings.api_keys)
        self.tokenizer = self.engine.tokenizer
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)

    # --- entry points ---------------------------------------------------------

    async def completions(self, body: CompletionRequest, http: HTTPRequest, api_key: str):
        self._check_model(body.model)
        jobs: list[_Job] = []
        for prompt_index, prompt in enumerate(body.prompts()):
            if isinstance(prompt, str):
                token_ids, text = self._require_tokenizer().encode(prompt), prompt
            else:
                token_ids = list(prompt)
                text = self.tokenizer.decode(token_ids, skip_special_tokens=False) if body.echo and self.tokenizer else ""
            params = body.sampling_params(self._default_max_tokens(len(token_ids)))
            jobs.extend(self._jobs(prompt_index, token_ids, params, body.n, len(jobs), text))
        return await self._respond(body, http, api_key, jobs, _CompletionFormat(self, body.echo))

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest, api_key: str):
        self._check_model(body.model)
        tokenizer = self._require_tokenizer()
        token_ids = tokenizer.encode_chat(body.template_messages(), body.add_generation_prompt)
        params = body.sampling_params(self._default_max_tokens(len(token_ids)))
        jobs = self._jobs(0, token_ids, params, body.n, 0)
        return await self._respond(body, http, api_key, jobs, _ChatFormat(self))

    # --- shared machinery -----------------------------------------------------

    def _default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Room left in the context (and in the whole KV pool), as vLLM defaults max_tokens."""
        kv = self.engine.kv_manager
        limit = min(self.engine.max_model_len, kv.num_blocks * kv.block_size)
        return max(limit - num_prompt_tokens, 1)

    def _jobs(self, prompt_index: int, token_ids: list[int], params: SamplingParams, n: int, first_index: int,
              prompt_text: str = "") -> list[_Job]:
        self.engine.validate_request(token_ids, params)
        jobs = []
        for choice in range(n):
            choice_params = params
            if n > 1 and params.seed is not None:
                # Same seed for every choice would give n identical samples.
                choice_params = replace(params, seed=params.seed + choice)
            jobs.append(_Job(first_index + choice, prompt_index, token_ids, choice_params, prompt_text))
        return jobs

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise model_not_found(model)

    def _require_tokenizer(self):
        try:
            return self.engine.loaded.require_tokenizer()
        except KVServeError as exc:
            raise bad_request(str(exc)) from None

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _respond(self, body, http: HTTPRequest, api_key: str, jobs: list[_Job], fmt: "_Format"):
        waiting, limit = self.async_engine.num_waiting, self.settings.max_waiting_requests
        if waiting + len(jobs) > limit:
            raise overloaded(waiting, limit)
        salt = self.tenancy.cache_salt(api_key, body.cache_salt)
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        if self.settings.log_prompts:
            for job in jobs:
                log.info("request %s-%d prompt: %r", request_id, job.index,
                         self.tokenizer.decode(job.token_ids) if self.tokenizer else job.token_ids)
        fanout = _Fanout(self.async_engine, jobs, request_id, salt)
        if body.stream:
            return _FanoutStream(fanout, self._sse(fmt, request_id, jobs, fanout.outputs(), body.include_usage))
        try:
            finals = await self._collect_unless_disconnected(fanout, http)
        finally:
            fanout.close()
        return fmt.response(request_id, jobs, finals)

    async def _collect_unless_disconnected(self, fanout: "_Fanout", http: HTTPRequest) -> dict[int, RequestOutput]:
        async def collect() -> dict[int, RequestOutput]:
            finals = {}
            async for index, output in fanout.outputs():
                if output.finished:
                    finals[index] = output
            return finals

        task = asyncio.create_task(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await http.is_disconnected():
                    log.info("client disconnected before its response was ready; request aborted")
                    return {}
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _sse(self, fmt: "_Format", request_id: str, jobs: list[_Job], outputs, include_usage: bool):
        last: dict[int, RequestOutput] = {}
        sent_logprobs: dict[int, int] = {}
        try:
            for chunk in fmt.opening_chunks(request_id, jobs):
                yield _sse_event(chunk)
            async for index, output in outputs:
                last[index] = output
                completion = output.outputs[0]
                new_logprobs = None
                if completion.logprobs is not None:
                    start = sent_logprobs.get(index, 0)
                    new_logprobs = completion.logprobs[start:]
                    sent_logprobs[index] = len(completion.logprobs)
                chunk = fmt.chunk(request_id, jobs[index], output, new_logprobs)
                if chunk is not None:
                    yield _sse_event(chunk)
            if include_usage:
                yield _sse_event(fmt.envelope(request_id, [], usage=_usage(jobs, last), stream=True))
        except InvalidRequestError as exc:  # cannot change the status once streaming: say it in the stream
            yield _sse_event(bad_request(str(exc), exc.param).body())
        except KVServeError as exc:
            yield _sse_event({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"

    def token_text(self, token_id: int) -> str:
        return self._token_text(token_id)


class _Fanout:
    """One engine request per job, started now (so the waiting queue counts them at once), merged
    into one stream of (choice index, output). `close()` aborts whatever has not finished."""

    def __init__(self, async_engine: AsyncEngine, jobs: list[_Job], request_id: str, salt: str | None) -> None:
        self.async_engine = async_engine
        self.request_ids = [f"{request_id}-{job.index}" for job in jobs]
        self._finished: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()
        streams = [async_engine.generate(job.token_ids, job.params, rid, salt)
                   for job, rid in zip(jobs, self.request_ids)]
        self._tasks = [asyncio.create_task(self._pump(job.index, stream)) for job, stream in zip(jobs, streams)]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                if output.finished:
                    self._finished.add(output.request_id)
                self._queue.put_nowait((index, output))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._tasks)
        while remaining:
            index, item = await self._queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for request_id in self.request_ids:  # also those whose pump never started
            if request_id not in self._finished:
                self.async_engine.abort(request_id)


class _FanoutStream(StreamingResponse):
    """A streaming response that closes its fan-out however the response ends (done, error, disconnect)."""

    def __init__(self, fanout: _Fanout, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.fanout = fanout

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.fanout.close()


def _sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict:
    """Prompt tokens once per prompt (not per choice); cached tokens of each prompt's first choice."""
    prompt_tokens = cached = 0
    counted: set[int] = set()
    for job in jobs:  # jobs run prompt by prompt, choice by choice: the first of each prompt counts
        if job.prompt_index in counted:
            continue
        counted.add(job.prompt_index)
        prompt_tokens += len(job.token_ids)
        output = finals.get(job.index)
        cached += output.num_cached_tokens if output is not None else 0
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Format(abc.ABC):
    """How one endpoint shapes its bodies and chunks."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.created = int(time.time())

    def envelope(self, request_id: str, choices: list[dict], usage: dict | None = None, stream: bool = False) -> dict:
        body = {
            "id": request_id, "object": self.chunk_object_name if stream else self.object_name,
            "created": self.created, "model": self.serving.settings.model_name, "choices": choices,
        }
        if usage is not None or not stream:
            body["usage"] = usage
        return body

    def response(self, request_id: str, jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict:
        choices = [self.final_choice(job, finals[job.index]) for job in jobs if job.index in finals]
        return self.envelope(request_id, choices, usage=_usage(jobs, finals))

    def opening_chunks(self, request_id: str, jobs: list[_Job]) -> list[dict]:
        return []

    @abc.abstractmethod
    def final_choice(self, job: _Job, output: RequestOutput) -> dict:
        """The choice object of a non-streaming response."""

    @abc.abstractmethod
    def chunk(self, request_id: str, job: _Job, output: RequestOutput,
              new_logprobs: list[TokenLogprob] | None) -> dict | None:
        """The SSE chunk for one step's output (None: nothing to send yet)."""


class _CompletionFormat(_Format):
    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def __init__(self, serving: OpenAIServing, echo: bool) -> None:
        super().__init__(serving)
        self.echo = echo
        self._offsets: dict[int, int] = {}  # characters streamed so far per choice (text_offset)
        self._echoed: set[int] = set()

    def final_choice(self, job: _Job, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        text = (job.prompt_text if self.echo else "") + completion.text
        logprobs = None
        if completion.logprobs is not None:
            entries: list[TokenLogprob | None] = list(completion.logprobs)
            if self.echo:
                entries = _prompt_entries(job, output) + entries
            logprobs = self._logprobs(entries, 0)
        return {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}

    def chunk(self, request_id, job, output, new_logprobs):
        completion = output.outputs[0]
        text = completion.delta_text
        entries: list[TokenLogprob | None] | None = None if new_logprobs is None else list(new_logprobs)
        if self.echo and job.index not in self._echoed:
            self._echoed.add(job.index)
            text = job.prompt_text + text
            if entries is not None:
                entries = _prompt_entries(job, output) + entries
        if not text and not output.finished and not entries:
            return None
        start = self._offsets.get(job.index, 0)
        logprobs = None if entries is None else self._logprobs(entries, start)
        self._offsets[job.index] = start + len(text)
        finish = completion.finish_reason if output.finished else None
        return self.envelope(request_id, [{"index": job.index, "text": text, "logprobs": logprobs,
                                           "finish_reason": finish}], stream=True)

    def _logprobs(self, entries: list[TokenLogprob | None], offset: int) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        token_text = self.serving.token_text
        for entry in entries:
            if entry is None:  # the first prompt token has no logprob
                tokens.append("")
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(offset)
                continue
            text = token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top_logprobs.append({token_text(t): lp for t, lp in entry.top} if entry.top else None)
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def _prompt_entries(job: _Job, output: RequestOutput) -> list[TokenLogprob | None]:
    """The echoed prompt's logprob entries (None where the engine has none, as for the first token)."""
    return list(output.prompt_logprobs or [None] * len(job.token_ids))


class _ChatFormat(_Format):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def final_choice(self, job: _Job, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        return {
            "index": job.index, "message": {"role": "assistant", "content": completion.text},
            "logprobs": self._logprobs(completion.logprobs), "finish_reason": completion.finish_reason,
        }

    def opening_chunks(self, request_id, jobs):
        # OpenAI's first chunk of each choice carries only the role.
        return [self.envelope(request_id, [{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], stream=True) for job in jobs]

    def chunk(self, request_id, job, output, new_logprobs):
        completion = output.outputs[0]
        if not completion.delta_text and not output.finished and not new_logprobs:
            return None
        delta = {"content": completion.delta_text} if completion.delta_text or not output.finished else {}
        return self.envelope(request_id, [{
            "index": job.index, "delta": delta, "logprobs": self._logprobs(new_logprobs),
            "finish_reason": completion.finish_reason if output.finished else None,
        }], stream=True)

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
