"""/v1/chat/completions: messages rendered by the model's chat template, `n` choices."""

from __future__ import annotations

from fastapi import Request as HTTPRequest

from kvserve.engine.output import RequestDelta, RequestOutput, TokenLogprob
from kvserve.server.core.serving import Serving
from kvserve.server.core.streaming import Job
from kvserve.server.openai.format import OpenAIFormat
from kvserve.server.openai.protocol import ChatCompletionRequest


class ChatServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: ChatCompletionRequest, http: HTTPRequest, api_key: str):
        serving = self.serving
        serving.check_model(body.model)
        body.check()
        serving.check_batch_size(body.n, "n")
        jobs = await serving.off_loop(self._jobs, body)
        fmt = ChatFormat(serving, body.include_usage, body.prompt_logprobs is not None)
        return await serving.respond(fmt, jobs, http, api_key, body.cache_salt, body.stream)

    def _jobs(self, body: ChatCompletionRequest) -> list[Job]:
        """(worker) Render, tokenize and validate the conversation."""
        serving = self.serving
        token_ids = serving.encode_chat(body.template_messages(), body.add_generation_prompt)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = serving.default_max_tokens(len(token_ids))
        params = body.sampling_params(max_tokens)
        return serving.jobs(0, token_ids, params, body.n, 0)


class ChatFormat(OpenAIFormat):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def final_choice(self, job: Job, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        return {
            "index": job.index, "message": {"role": "assistant", "content": completion.text},
            "logprobs": self._logprobs(completion.logprobs), "finish_reason": completion.finish_reason,
        }

    def opening_chunks(self, jobs):
        # OpenAI's first chunk of each choice carries only the role.
        return [self.envelope([{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], stream=True) for job in jobs]

    def chunk(self, job: Job, delta: RequestDelta) -> dict | None:
        if not delta.new_text and not delta.finished and not delta.new_logprobs:
            return None
        content = {"content": delta.new_text} if delta.new_text or not delta.finished else {}
        return self.envelope([{
            "index": job.index, "delta": content, "logprobs": self._logprobs(delta.new_logprobs),
            "finish_reason": delta.finish_reason if delta.finished else None,
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
