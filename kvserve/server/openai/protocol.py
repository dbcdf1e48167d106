"""OpenAI request bodies (with vLLM's extra sampling fields) and their translation to SamplingParams.

Type errors are pydantic's (-> 400); value ranges are SamplingParams' own
validation, so the server and the offline API reject the same things with the
same messages (the OpenAPI schema states the same ranges). Every string must
be valid Unicode text. Unknown fields are ignored, as OpenAI and vLLM do,
except features kvserve does not implement (logit_bias, image and other non-text
content parts), which are refused by name rather than silently dropped. Tools and
structured output are in tool_protocol.py.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from kvserve.engine.sample.sampling import (
    MAX_LOGPROBS, MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, SEED_RANGE, SamplingParams,
)
from kvserve.errors import InvalidRequestError
from kvserve.server.core.fields import (Integer, NonEmptyText, NullMeansDefault, Number, Text, bounded, needs_tools,
                                     non_empty_list, required_in_schema, required_when, sampling_params)
from kvserve.server.core.priority import PRIORITY_RANGE, ServiceTier, request_priority
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.structured_output import (ResponseFormat, StructuredOutputsField, one_constraint,
                                                   response_format_constraint, vllm_structured_outputs)
from kvserve.server.core.tool_use import ToolUse, link_tool_results
from kvserve.server.prompt.builder import Conversation
from kvserve.server.openai.tool_protocol import ChatTool, ChatToolCall, ChatToolChoice, chat_tool_use
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.rendering import Turn

# The field's shape, in the schema: "none", or METHOD:RATIO with a known method and a ratio >= 1 (what the engine can
# run beyond that, e.g. a method reading queries or a server that drafts, is its 400).
KV_COMPRESSION_PATTERN = r"^\s*(none|(auto|streaming|knorm|keydiff|expected_attention):[1-9][0-9]*(\.[0-9]+)?)\s*$"

# Most choices one request may ask for (OpenAI's bound for n).
MAX_CHOICES = 128
# A prompt token id; its upper bound is the model's vocabulary, which the engine checks.
TokenId = Annotated[Integer, Field(json_schema_extra={"minimum": 0})]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


def _needs(field: str, field_type: str, then: dict) -> dict:
    """A schema rule: when `field` is given (not null), `then` holds (what `check` refuses otherwise)."""
    return {"if": {"required": [field], "properties": {field: {"type": field_type}}}, "then": then}


_TRUE = {"const": True}
# stream_options only with stream=true; prompt_logprobs only without it.
# A JSON response_format and vLLM's structured_outputs both constrain the output: one at a time.
_ONE_CONSTRAINT = {
    "if": {"required": ["response_format"], "properties": {"response_format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}},
    "then": {"properties": {"structured_outputs": {"type": "null"}}}}
_SAMPLING_RULES = [_needs("stream_options", "object", {"required": ["stream"], "properties": {"stream": _TRUE}}),
                   _needs("prompt_logprobs", "integer", {"properties": {"stream": {"not": _TRUE}}}),
                   _ONE_CONSTRAINT]
# top_logprobs needs logprobs=true; a tool_choice that demands a call needs tools.
_CHAT_RULES = [*_SAMPLING_RULES,
               _needs("top_logprobs", "integer", {"required": ["logprobs"], "properties": {"logprobs": _TRUE}}),
               needs_tools({"anyOf": [{"const": "required"}, {"type": "object"}]})]


class _SamplingRequest(NullMeansDefault):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": _SAMPLING_RULES})

    model: Text | None = None
    max_tokens: Integer | None = bounded(minimum=1)
    temperature: Number | None = bounded(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: Number | None = bounded(exclusiveMinimum=0, maximum=1)
    n: Integer | None = bounded(1, minimum=1, maximum=MAX_CHOICES)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[NonEmptyText] | None = None  # "" alone: no stop string
    seed: Integer | None = bounded(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    presence_penalty: Number | None = bounded(0.0, minimum=-2, maximum=2)
    frequency_penalty: Number | None = bounded(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, Number] | None = None
    user: Text | None = None
    # vLLM extras
    top_k: Integer | None = bounded(minimum=-1)
    min_p: Number | None = bounded(minimum=0, maximum=1)
    repetition_penalty: Number | None = bounded(minimum=REPETITION_PENALTY_RANGE[0],
                                                 maximum=REPETITION_PENALTY_RANGE[1])
    ignore_eos: StrictBool = False
    stop_token_ids: list[Integer] | None = bounded(items={"type": "integer", "minimum": 0})
    skip_special_tokens: StrictBool = True
    cache_salt: Text | None = Field(default=None, min_length=1)
    # Scheduling among the caller's own requests: vLLM's `priority` (lower first) and OpenAI's `service_tier`
    # ("priority" ahead, "flex" behind; server/core/priority.py). Never a claim against another API key's share.
    priority: Integer | None = bounded(minimum=PRIORITY_RANGE[0], maximum=PRIORITY_RANGE[1])
    service_tier: ServiceTier | None = None
    # Log-probabilities of each prompt token after the first, in vLLM's shape (not with stream=true).
    prompt_logprobs: Integer | None = bounded(minimum=0, maximum=MAX_LOGPROBS)
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs (json/regex/choice/grammar).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # KV compression for this request (vLLM-style extra field): "METHOD:RATIO", or "none" (off) over the server's
    # --kv-compression; usage then reports prompt_tokens_details.kvserve_dropped_tokens.
    kv_compression: Annotated[str, Field(pattern=KV_COMPRESSION_PATTERN)] | None = None

    def check(self) -> None:
        """Checks that need no prompt (call before tokenizing); ranges of sampling values are
        SamplingParams' own, in `sampling_params`."""
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}", param="n")
        if self.n > MAX_CHOICES:
            raise InvalidRequestError(f"n must be <= {MAX_CHOICES}, got {self.n}", param="n")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not available with stream=true (as in vLLM)",
                                      param="prompt_logprobs")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")

    @property
    def requested_max_tokens(self) -> int | None:
        """The output cap the request gave (None: the server's default, `Serving.default_max_tokens`)."""
        return self.max_tokens

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                         renamed: dict[str, str] | None = None,
                         constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        values: dict[str, Any] = dict(
            max_tokens=max_tokens,
            stop=self.stop or [], seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [], skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if constraint is not None:
            values["structured_outputs"] = constraint
        if self.kv_compression is not None:
            values["kv_compression"] = self.kv_compression
        return sampling_params(values, renamed or {})

    @property
    def scheduling_priority(self) -> int:
        return request_priority(self.priority, self.service_tier)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: (NonEmptyText | non_empty_list(TokenId)
             | non_empty_list(NonEmptyText)
             | non_empty_list(non_empty_list(TokenId)))
    echo: StrictBool | None = False
    logprobs: Integer | None = bounded(minimum=0, maximum=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: Integer | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")

    # OpenAI's default max_tokens for completions (chat's runs to the end of the context).
    API_DEFAULT_MAX_TOKENS: ClassVar[int] = 16

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # echo with logprobs scores the prompt too
        constraint = one_constraint(("response_format", response_format_constraint(self.response_format)),
                                    ("structured_outputs", vllm_structured_outputs(self.structured_outputs)))
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, constraint=constraint)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, token ids, or a list of either."""
        prompt = self.prompt  # never empty, nor any prompt in it (the schema's minLength / minItems)
        return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)


_IMAGE_PART_TYPES = ("image_url", "input_image", "image")


class ContentPart(BaseModel):
    """A part of a message's content. Only text is served; other kinds are refused by name.

    The schema requires `text` (a text part has one); the check below says why a part without it
    is refused (an image, an audio part) rather than only that `text` is missing."""

    model_config = ConfigDict(extra="allow", json_schema_extra=required_in_schema("text"))

    type: Text = Field(json_schema_extra={"enum": ["text"]})
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type in _IMAGE_PART_TYPES:
            raise PydanticCustomError("unsupported_content", "images are not supported")
        if self.type != "text":
            raise PydanticCustomError("unsupported_content", "{part_type} content parts are not supported",
                                      {"part_type": self.type})
        if self.text is None:
            raise PydanticCustomError("missing_text", "a text content part needs `text`")
        return self


# Only an assistant turn may come without content (OpenAI's, where tool calls stand in for it).
_CONTENT_REQUIRED = {"if": {"properties": {"role": {"enum": ["system", "developer", "user"]}}},
                     "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        **_CONTENT_REQUIRED, "allOf": required_when("role", {"tool": ("content", "tool_call_id")})})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ChatToolCall] | None = None  # assistant
    tool_call_id: Text | None = None  # tool: the call this message answers
    reasoning_content: Text | None = None  # assistant: its thinking, as the response gave it (vLLM's name)
    reasoning: Text | None = None  # (vLLM's newer name for the same)

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing_content", "a {role} message needs `content`", {"role": self.role})
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing_tool_call_id", "a tool message needs `tool_call_id`")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": _CHAT_RULES})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = bounded(minimum=1)
    logprobs: StrictBool | None = False
    top_logprobs: Integer | None = bounded(minimum=0, maximum=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list[ChatTool] | None = None
    tool_choice: ChatToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Reasoning: vLLM's template variables (`{"enable_thinking": false}`) and OpenAI's effort (gpt-oss's depth;
    # "none" turns thinking off where the template can).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        if self.max_completion_tokens is not None and self.max_tokens is not None and self.max_tokens < 1:
            # max_completion_tokens wins, but a max_tokens out of range is still refused, as the schema says
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens}", param="max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_use(self) -> ToolUse:
        return chat_tool_use(self.tools, self.tool_choice, self.parallel_tool_calls, self.response_format,
                             self.structured_outputs)

    def sampling_params(self, max_tokens: int, tool_use: ToolUse | None = None,
                        reasoning: ReasoningUse | None = None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # The errors name the field the request used: top_logprobs is what becomes `logprobs`.
        renamed = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        constraint = (tool_use or self.tool_use()).constraint()
        if reasoning is not None:
            constraint = reasoning.gate(constraint)
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, renamed, constraint)

    def reasoning_use(self, template: str | None) -> ReasoningUse:
        effort = self.reasoning_effort
        return ReasoningUse.of(template, None, effort if effort != "minimal" else "low", self.chat_template_kwargs,
                               param="reasoning_effort")

    def to_conversation(self, tool_use: ToolUse, tenant: str | None, variables: dict[str, Any] | None = None
                        ) -> Conversation:
        """The request as the prompt builder takes it (`tenant`: whose generated answers are spliced back;
        `variables`: more template variables, the reasoning switch)."""
        return Conversation(self.turns(), tool_use.tools, add_generation_prompt=self.add_generation_prompt,
                            variables=dict(variables or {}), tenant=tenant)

    def turns(self) -> list[Turn]:
        """The conversation, API-neutral; a tool message must answer an earlier call (400 otherwise)."""
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        turns = [Turn("system" if m.role == "developer" else m.role, m.text(),
                      [c.call() for c in m.tool_calls or []] if m.role == "assistant" else [], m.tool_call_id,
                      reasoning=(m.reasoning_content or m.reasoning or "") if m.role == "assistant" else "")
                 for m in self.messages]
        link_tool_results(turns)
        return turns
