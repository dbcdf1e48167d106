"""Anthropic Messages API request bodies (`POST /v1/messages`) and their SamplingParams.

Text, `tool_use`, `tool_result` and `thinking` blocks; `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`
on system and message blocks and on tool definitions marks breakpoints (at most 4, as Anthropic).
`thinking` turns a reasoning model's thinking on or off (server/core/reasoning_use.py). Images, documents and
server tools are refused by name.
`MessagesPrompt` is what `POST /v1/messages/count_tokens` takes: the prompt without the sampling.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.prefix.pins import TTL_SECONDS
from kvserve.server.core.fields import (Integer, NonEmptyText, NullMeansDefault, Number, Text, bounded,
                                     check_typed_fields, needs_tools,
                                     required_in_schema, required_when, sampling_params)
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.tool_use import ToolUse
from kvserve.tools.calls import FunctionTool
from kvserve.tools.grammar import ToolChoice

MAX_BREAKPOINTS = 4  # as Anthropic


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def ttl_s(self) -> float:
        return TTL_SECONDS[self.ttl]


class TextBlock(BaseModel):
    # The schema requires `text` (a text block has one); the check says why a block without it is
    # refused (an image, a document) rather than only that `text` is missing.
    model_config = ConfigDict(extra="allow", json_schema_extra=required_in_schema("text"))

    type: Text = Field(json_schema_extra={"enum": ["text"]})
    text: Text | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "TextBlock":
        if self.type != "text":
            raise PydanticCustomError("unsupported_content", "{block_type} content blocks are not supported "
                                      "(text only)", {"block_type": self.type})
        if self.text is None:
            raise PydanticCustomError("missing_text", "a text block needs `text`")
        return self


_BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                 "compaction": (), "thinking": ("thinking",), "redacted_thinking": ("data",)}


class ContentBlock(BaseModel):
    """A message block: text, a `tool_use` (assistant), a `tool_result` (user) or a `compaction` (assistant:
    the summary that stands for every block before it; null content: a failed compaction, a no-op)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": required_when("type", _BLOCK_FIELDS)})

    type: Text = Field(json_schema_extra={"enum": list(_BLOCK_FIELDS)})
    text: Text | None = None
    thinking: Text | None = None  # thinking: an earlier answer's thinking, sent back
    signature: Text | None = None  # thinking (kvserve signs nothing: "")
    data: Text | None = None  # redacted_thinking (kvserve writes none; ignored)
    cache_control: CacheControl | None = None
    id: Text | None = None  # tool_use
    name: Text | None = None  # tool_use
    input: Any = None  # tool_use: the arguments object
    tool_use_id: Text | None = None  # tool_result
    content: Text | list[TextBlock] | None = None  # tool_result; compaction: the summary
    is_error: StrictBool | None = None  # tool_result
    encrypted_content: Text | None = None  # compaction: round-tripped, unused here

    @model_validator(mode="after")
    def _known_block(self) -> "ContentBlock":
        check_typed_fields(self, _BLOCK_FIELDS, "content blocks", "unsupported_content")
        return self

    def result_text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    def blocks(self) -> list[ContentBlock]:
        return [ContentBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolParam(BaseModel):
    """A client tool (server tools, with a `type` such as web_search_..., are refused)."""

    model_config = ConfigDict(extra="ignore")

    name: NonEmptyText
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": required_when("type", {"tool": ("name",)})})

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MessagesPrompt(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": [
        needs_tools({"properties": {"type": {"enum": ["any", "tool"]}}})]})

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    # Extended thinking: {"type": "enabled", "budget_tokens": N} (the budget is not enforced: max_tokens bounds the
    # whole answer) or {"type": "disabled"}, on a model whose template knows thinking.
    thinking: dict[str, Any] | None = None

    def tool_use(self) -> ToolUse:
        tools = [FunctionTool(t.name, t.description, t.input_schema) for t in self.tools or []]
        choice, parallel = ToolChoice("auto" if tools else "none"), True
        if self.tool_choice is not None:
            mode = {"any": "required", "tool": "named"}.get(self.tool_choice.type, self.tool_choice.type)
            if mode == "named" and not self.tool_choice.name:
                raise InvalidRequestError("tool_choice of type 'tool' needs a `name`", param="tool_choice")
            choice = ToolChoice(mode, self.tool_choice.name if mode == "named" else None)
            parallel = not self.tool_choice.disable_parallel_tool_use
        use = ToolUse(tools, choice, parallel, call_id_prefix="toolu_")
        use.check()
        return use

    def reasoning_use(self, template: str | None) -> ReasoningUse:
        """The request's `thinking` switch on the model whose chat template is `template`."""
        kind = (self.thinking or {}).get("type")
        if kind not in (None, "enabled", "disabled"):
            raise InvalidRequestError(f"thinking.type must be enabled or disabled, got {kind!r}", param="thinking")
        return ReasoningUse.of(template, None if kind is None else kind == "enabled", param="thinking")

    def check(self) -> None:
        if self.messages[-1].role == "assistant":
            raise InvalidRequestError("a last assistant message (prefilling the answer) is not supported; end with "
                                      "a user message", param="messages")
        breakpoints = sum(block.cache_control is not None for block in self.system_blocks()) + sum(
            block.cache_control is not None for m in self.messages for block in m.blocks()) + sum(
            tool.cache_control is not None for tool in self.tools or [])
        if breakpoints > MAX_BREAKPOINTS:
            raise InvalidRequestError(f"{breakpoints} blocks have cache_control; at most {MAX_BREAKPOINTS} "
                                      f"breakpoints are allowed", param="cache_control")

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        return [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) else self.system


class InputTokens(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_tokens"]
    value: Integer = bounded(..., minimum=1)


class ToolUses(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_uses"]
    value: Integer = bounded(..., minimum=0)


class ContextEdit(BaseModel):
    """One `context_management` edit (beta): `clear_tool_uses_20250919` (the oldest tool results cleared past
    `trigger`, the last `keep` kept) or `compact_20260112` (the history summarized past `trigger`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["clear_tool_uses_20250919", "compact_20260112"]
    trigger: InputTokens | ToolUses | None = None
    keep: ToolUses | None = None  # clear_tool_uses
    clear_at_least: InputTokens | None = None  # clear_tool_uses
    exclude_tools: list[Text] | None = None  # clear_tool_uses
    clear_tool_inputs: StrictBool | list[Text] | None = None  # clear_tool_uses
    instructions: Text | None = None  # compact: in place of kvserve's summarizing request
    pause_after_compaction: StrictBool | None = None  # compact


class ContextManagement(BaseModel):
    model_config = ConfigDict(extra="ignore")

    edits: list[ContextEdit] = Field(default_factory=list)


class MessagesRequest(MessagesPrompt):
    max_tokens: Integer = bounded(..., minimum=1)  # required, as Anthropic's API
    stop_sequences: list[NonEmptyText] | None = None
    temperature: Number | None = bounded(minimum=0, maximum=1)
    top_p: Number | None = bounded(exclusiveMinimum=0, maximum=1)
    top_k: Integer | None = bounded(minimum=0)
    stream: StrictBool | None = False
    metadata: dict[str, Any] | None = None
    ignore_eos: StrictBool = False  # vLLM's extra, as on the other endpoints (benchmarks)
    context_management: ContextManagement | None = None  # beta (anthropic/context_edits.py)

    def check(self) -> None:
        super().check()
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        # Anthropic's ranges, narrower than SamplingParams' (temperature up to 1, no top_k of -1).
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise InvalidRequestError(f"temperature must be in [0, 1], got {self.temperature}", param="temperature")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}", param="top_k")

    def sampling_params(self, max_tokens: int, constraint: Any = None) -> SamplingParams:
        """`constraint`: the StructuredOutputsParams the tools ask for (ToolUse.constraint)."""
        values: dict[str, Any] = dict(max_tokens=max_tokens, stop=self.stop_sequences or [], ignore_eos=self.ignore_eos)
        if constraint is not None:
            values["structured_outputs"] = constraint
        if self.temperature is not None:
            values["temperature"] = self.temperature
        if self.top_p is not None:
            values["top_p"] = self.top_p
        if self.top_k:  # Anthropic's 0 means "not set"
            values["top_k"] = self.top_k
        return sampling_params(values, {})
