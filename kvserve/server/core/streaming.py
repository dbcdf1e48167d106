"""One API request fanned out into engine requests, and the two ways its results go back.

A request becomes one engine request per job (a choice of a prompt): `n`
choices of a prompt run side by side and share the prompt's KV blocks through
the prefix cache. Their deltas merge into one stream. A non-streaming request
assembles the finals (RequestOutputAssembler) while watching for the client to
leave; a streaming one hands every delta to its API's `OutputFormat`, which
turns it into Server-Sent Events, and assembles the finals too (for the usage
at the end). However a request ends (done, error, disconnect), every engine
request it started that has not finished is aborted, which frees its blocks.

Each API (completions, chat, and later Responses and Anthropic Messages) is an
`OutputFormat`; this module is the machinery they share.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.output.types import RequestDelta, RequestOutput, RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import KVServeError
from kvserve.kv.prefix.pins import PinRequest

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


@dataclass
class Job:
    """One engine request: choice `index` of prompt `prompt_index`. A request's jobs are
    numbered 0, 1, ... in order (prompt by prompt, choice by choice)."""

    index: int
    prompt_index: int
    token_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""
    pins: tuple[PinRequest, ...] = field(default=())  # cache breakpoints in the prompt (kv/prefix/pins.py)


class OutputFormat(abc.ABC):
    """How one API shapes its results: a whole body, or a stream of SSE events.

    `request_id` names the response; its engine requests are `{request_id}-{job index}`.
    """

    request_id: str
    media_type = "text/event-stream"  # of the stream (Ollama's: NDJSON)

    @abc.abstractmethod
    def response(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        """The non-streaming body (`finals`: final output by job index; empty if the client left)."""

    def opening_events(self, jobs: list[Job]) -> Iterable[str]:
        """Events sent before any output."""
        return ()

    @abc.abstractmethod
    def output_events(self, job: Job, delta: RequestDelta) -> Iterable[str]:
        """Events for what one step added to `job`."""

    @abc.abstractmethod
    def closing_events(self, jobs: list[Job], finals: dict[int, RequestOutput], error: KVServeError | None
                       ) -> Iterable[str]:
        """The stream's last events: after every job finished (`finals` by job index), or after
        `error` (the status is already 200 once streaming, so an error can only be said in the stream)."""


def sse_event(payload: dict | str, event: str | None = None) -> str:
    """One Server-Sent Event; `payload` a JSON object or a literal such as "[DONE]"."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


async def run_jobs(async_engine: AsyncEngine, fmt: OutputFormat, jobs: list[Job], http: HTTPRequest,
                   cache_salt: str | None, stream: bool, tenant: str | None = None, priority: int = 0):
    """Start the jobs now (so the waiting queue counts them at once) and answer: an SSE stream,
    or the body once every job finished. `tenant`, `priority`: whose fair share they use, and their order
    among that tenant's requests (Engine.add_request)."""
    fanout = Fanout(async_engine, jobs, fmt.request_id, cache_salt, tenant, priority)
    if stream:
        return FanoutStream(fanout, _events(fmt, jobs, fanout), fmt.media_type)
    try:
        finals = await _collect_unless_disconnected(fanout, http)
    finally:
        fanout.close()
    return fmt.response(jobs, finals)


class Fanout:
    """One engine request per job, merged into one stream of (job index, delta).
    `close()` aborts whatever has not finished."""

    def __init__(self, async_engine: AsyncEngine, jobs: list[Job], request_id: str, salt: str | None,
                 tenant: str | None = None, priority: int = 0) -> None:
        self.async_engine = async_engine
        self.request_ids = [f"{request_id}-{job.index}" for job in jobs]
        self._finished: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()
        streams = [async_engine.generate(job.token_ids, job.params, rid, salt, job.pins, tenant, priority)
                   for job, rid in zip(jobs, self.request_ids)]
        self._tasks = [asyncio.create_task(self._pump(job.index, stream)) for job, stream in zip(jobs, streams)]

    async def _pump(self, index: int, stream: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in stream:
                if delta.finished:
                    self._finished.add(delta.request_id)
                self._queue.put_nowait((index, delta))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
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


class FanoutStream(StreamingResponse):
    """A streaming response that closes its fan-out however the response ends (done, error, disconnect)."""

    def __init__(self, fanout: Fanout, content: AsyncIterator[str], media_type: str = "text/event-stream") -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.fanout = fanout

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.fanout.close()


async def _collect_unless_disconnected(fanout: Fanout, http: HTTPRequest) -> dict[int, RequestOutput]:
    async def collect() -> dict[int, RequestOutput]:
        finals, assembler = {}, RequestOutputAssembler()
        async for index, delta in fanout.deltas():
            final = assembler.add(delta)
            if final is not None:
                finals[index] = final
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


async def _events(fmt: OutputFormat, jobs: list[Job], fanout: Fanout) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    assembler = RequestOutputAssembler()
    error: KVServeError | None = None
    try:
        for event in fmt.opening_events(jobs):
            yield event
        async for index, delta in fanout.deltas():
            final = assembler.add(delta)
            if final is not None:
                finals[index] = final
            for event in fmt.output_events(jobs[index], delta):
                yield event
    except KVServeError as exc:
        error = exc
    for event in fmt.closing_events(jobs, finals, error):
        yield event
