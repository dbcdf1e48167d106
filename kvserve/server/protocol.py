"""OpenAI request bodies (with vLLM's extra sampling fields) and their translation to SamplingParams.

Type errors are pydantic's (-> 400); value ranges are SamplingParams' own
validation, so the server and the offline API reject the same things with the
same messages. Unknown fields are ignored, as OpenAI and vLLM do, except
features kvserve does not implement, which are refused by name rather than
silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from kvserve.engine.sampling import SamplingParams
from kvserve.errors import InvalidRequestError

# Strict numbers: "0.7" (a string) is a type error, as in OpenAI's API; ints are accepted as floats.
Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    user: str | None = None
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    cache_salt: str | None = Field(default=None, min_length=1)

    def _check_common(self) -> None:
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}", param="n")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")

    def _sampling_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        values = dict(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=self.stop or [], seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [], skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        # OpenAI's default for completions is 16 tokens.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # echo with logprobs scores the prompt too
        return self._sampling_params(self.max_tokens, min(16, default_max_tokens), self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict] | None = None
    response_format: dict | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self._check_common()
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format type 'text' is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, default_max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
