"""/v1/completions: prompts (text, token ids, or a batch of either) x `n` choices, with echo and logprobs."""

from __future__ import annotations

from fastapi import Request as HTTPRequest

from kvserve.engine.output.types import RequestDelta, RequestOutput, TokenLogprob
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job
from kvserve.server.openai.format import OpenAIFormat
from kvserve.server.openai.protocol import CompletionRequest


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: CompletionRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        prompts = body.prompts()
        serving.check_batch_size(len(prompts) * body.n, "n" if len(prompts) == 1 else "prompt")
        jobs = await serving.off_loop(self._jobs, body, prompts)
        fmt = CompletionFormat(serving, body.echo, body.include_usage, body.prompt_logprobs is not None)
        return await serving.respond(fmt, jobs, http, api_key, body.cache_salt, body.stream,
                                     body.scheduling_priority)

    def _jobs(self, body: CompletionRequest, prompts: list[str | list[int]]) -> list[Job]:
        """(worker) Tokenize, validate, and for echo detokenize, every prompt."""
        serving = self.serving
        jobs: list[Job] = []
        for prompt_index, prompt in enumerate(prompts):
            token_ids = serving.prompts.encode_text(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
            max_tokens = body.requested_max_tokens
            if max_tokens is None:
                max_tokens = serving.default_max_tokens(len(token_ids), body.API_DEFAULT_MAX_TOKENS)
            params = body.sampling_params(max_tokens)
            prompt_jobs = serving.jobs(prompt_index, token_ids, params, body.n, len(jobs))
            if body.echo:  # after validation: only prompts that fit are decoded
                text = prompt if isinstance(prompt, str) else serving.decode_prompt(token_ids)
                for job in prompt_jobs:
                    job.prompt_text = text
            jobs.extend(prompt_jobs)
        return jobs


class CompletionFormat(OpenAIFormat):
    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def __init__(self, serving: Serving, echo: bool, include_usage: bool, prompt_logprobs: bool) -> None:
        super().__init__(serving, include_usage, prompt_logprobs)
        self.echo = echo
        # Per choice, where the next token's text starts (text_offset): the text of the tokens sent so
        # far, not of the text streamed so far, which lags behind while a possible stop string is held back.
        self._offsets: dict[int, int] = {}
        self._echoed: set[int] = set()

    def final_choice(self, job: Job, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        text = (job.prompt_text if self.echo else "") + completion.text
        logprobs = None
        if completion.logprobs is not None:
            entries = _generated_entries(completion.logprobs)
            if self.echo:
                entries = _prompt_entries(job, output.prompt_logprobs) + entries
            logprobs = self._logprobs(entries, 0)
        return {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}

    def chunk(self, job: Job, delta: RequestDelta) -> dict | None:
        text = delta.new_text
        entries = None if delta.new_logprobs is None else _generated_entries(delta.new_logprobs)
        if self.echo and job.index not in self._echoed:  # the first delta: it carries the prompt logprobs
            self._echoed.add(job.index)
            text = job.prompt_text + text
            if entries is not None:
                entries = _prompt_entries(job, delta.new_prompt_logprobs) + entries
        if not text and not delta.finished and not entries:
            return None
        logprobs = None
        if entries is not None:
            start = self._offsets.get(job.index, 0)
            logprobs = self._logprobs(entries, start)
            self._offsets[job.index] = start + sum(map(len, logprobs["tokens"]))
        finish = delta.finish_reason if delta.finished else None
        return self.envelope([{"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                             stream=True)

    def _logprobs(self, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> dict:
        """OpenAI's legacy logprobs: per token its text, logprob (None where the model gives none:
        the first prompt token), top alternatives, and where its text starts in the choice's text."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        token_text = self.serving.token_text
        for token_id, entry in entries:
            text = token_text(token_id)
            tokens.append(text)
            token_logprobs.append(None if entry is None else entry.logprob)
            top_logprobs.append({token_text(t): lp for t, lp in entry.top} if entry is not None and entry.top
                                else None)
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def _generated_entries(logprobs: list[TokenLogprob]) -> list[tuple[int, TokenLogprob | None]]:
    return [(entry.token_id, entry) for entry in logprobs]


def _prompt_entries(job: Job, prompt_logprobs: list[TokenLogprob | None] | None
                    ) -> list[tuple[int, TokenLogprob | None]]:
    """The echoed prompt's tokens with their logprob entries (None where the engine has none,
    as for the first token)."""
    entries = prompt_logprobs or [None] * len(job.token_ids)
    return list(zip(job.token_ids, entries))

