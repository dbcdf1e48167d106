"""What OpenAI's completions and chat completions share: the envelope around choices, usage,
streams of `data:` chunks ending in `data: [DONE]`, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import Iterable

from kvserve.engine.output.types import RequestDelta, RequestOutput
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.server.core.errors import bad_request, internal
from kvserve.server.core.serving import Serving, Usage
from kvserve.server.core.streaming import Job, OutputFormat, sse_event


class OpenAIFormat(OutputFormat):
    """An OpenAI body: {id, object, created, model, choices, usage}; subclasses shape the choices."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, serving: Serving, include_usage: bool = False, prompt_logprobs: bool = False) -> None:
        self.serving = serving
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = include_usage
        self.prompt_logprobs = prompt_logprobs  # the client asked for them (vLLM's field)

    def envelope(self, choices: list[dict], usage: dict | None = None, stream: bool = False) -> dict:
        body = {
            "id": self.request_id, "object": self.chunk_object_name if stream else self.object_name,
            "created": self.created, "model": self.serving.settings.model_name, "choices": choices,
        }
        if usage is not None or not stream:
            body["usage"] = usage
        return body

    def response(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        choices = []
        for job in jobs:
            if job.index in finals:
                choice = self.final_choice(job, finals[job.index])
                if self.prompt_logprobs:
                    choice["prompt_logprobs"] = self._prompt_logprobs(job, finals[job.index])
                choices.append(choice)
        return self.envelope(choices, usage=self.usage(jobs, finals))

    def opening_events(self, jobs: list[Job]) -> Iterable[str]:
        return [sse_event(chunk) for chunk in self.opening_chunks(jobs)]

    def output_events(self, job: Job, delta: RequestDelta) -> Iterable[str]:
        chunk = self.chunk(job, delta)
        return () if chunk is None else (sse_event(chunk),)

    def closing_events(self, jobs, finals, error: KVServeError | None) -> Iterable[str]:
        if isinstance(error, InvalidRequestError):
            yield sse_event(bad_request(str(error), error.param).body())
        elif error is not None:
            yield sse_event(internal(str(error)).body())
        elif self.include_usage:
            yield sse_event(self.envelope([], usage=self.usage(jobs, finals), stream=True))
        yield sse_event("[DONE]")

    def opening_chunks(self, jobs: list[Job]) -> list[dict]:
        return []

    def usage(self, jobs: list[Job], finals: dict[int, RequestOutput]) -> dict:
        return Usage.count(jobs, finals).openai()

    @abc.abstractmethod
    def final_choice(self, job: Job, output: RequestOutput) -> dict:
        """The choice object of a non-streaming response."""

    @abc.abstractmethod
    def chunk(self, job: Job, delta: RequestDelta) -> dict | None:
        """The SSE chunk for what one step added (None: nothing to send yet)."""

    def _prompt_logprobs(self, job: Job, output: RequestOutput) -> list[dict | None] | None:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
        with the prompt token and the top alternatives. A rank is null where the engine's top list
        does not settle it (the token ranks below every alternative it reported)."""
        if output.prompt_logprobs is None:
            return None
        token_text = self.serving.token_text
        positions: list[dict | None] = []
        for entry in output.prompt_logprobs:
            if entry is None:
                positions.append(None)
                continue
            top = {str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
                   for rank, (t, lp) in enumerate(entry.top, start=1)}
            above = sum(1 for _, lp in entry.top if lp > entry.logprob)
            rank = above + 1 if above < len(entry.top) else None
            top.setdefault(str(entry.token_id), {"logprob": entry.logprob, "rank": rank,
                                                 "decoded_token": token_text(entry.token_id)})
            positions.append(top)
        return positions
