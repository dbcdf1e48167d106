"""OpenAI Responses API request bodies (`POST /v1/responses`) and their SamplingParams.

Type errors are pydantic's (-> 400); ranges are SamplingParams' own. Function
tools, `function_call` / `function_call_output` items and `text.format` json
output are served (server/core/tool_use.py); what the model cannot serve —
other tool types, images, files, other item types, background mode —
is refused by name, never ignored. `compaction` items (server/compaction/) stand for every item before
them; `context_management` compaction and `conversation` are served (responses/compacting.py,
responses/conversations.py). `reasoning.effort` and reasoning items are served on a model whose template
knows thinking (server/core/reasoning_use.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from kvserve.engine.sample.sampling import MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, SEED_RANGE, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.prefix.pins import TTL_SECONDS
from kvserve.server.core.priority import PRIORITY_RANGE, ServiceTier
from kvserve.server.core.fields import (Integer, NonEmptyText, NullMeansDefault, Number, Text, bounded,
                                     check_typed_fields, needs_tools,
                                     non_empty_list, required_in_schema, required_when, sampling_params)
from kvserve.server.compaction.summary import compacted_instructions
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.structured_output import text_format_constraint
from kvserve.server.core.tool_use import ToolUse, link_tool_results
from kvserve.server.prompt.builder import Conversation
from kvserve.tools.calls import FunctionTool, ToolCall
from kvserve.tools.grammar import ToolChoice
from kvserve.tools.rendering import Turn

_TEXT_PART_TYPES = ("input_text", "output_text", "text", "reasoning_text")
MAX_METADATA_KEYS = 16  # as OpenAI


class InputContent(BaseModel):
    """A content part of an input message: only text is served (the schema requires `text`; the
    check says why a part without it is refused)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=required_in_schema("text"))

    type: Text = Field(json_schema_extra={"enum": list(_TEXT_PART_TYPES)})
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "InputContent":
        if self.type not in _TEXT_PART_TYPES:
            raise PydanticCustomError("unsupported_content", "{part_type} content is not supported (text only)",
                                      {"part_type": self.type})
        if self.text is None:
            raise PydanticCustomError("missing_text", "a text content part needs `text`")
        return self


_ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "compaction": ("encrypted_content",), "reasoning": ()}


class InputMessage(BaseModel):
    """An input item: a message, a function call the model made, a function's output, or a reasoning item (an
    earlier answer's thinking, sent back: it goes with the assistant turn after it); no references, other tools'
    calls."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": required_when("type", _ITEM_FIELDS, "message")})

    type: Text = Field("message", json_schema_extra={"enum": list(_ITEM_FIELDS)})
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Text | list[InputContent] | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Text | None = None
    encrypted_content: Text | None = None
    summary: list[Any] | None = None  # reasoning

    @model_validator(mode="after")
    def _known_item(self) -> "InputMessage":
        check_typed_fields(self, _ITEM_FIELDS, "input items", "unsupported_item")
        return self

    def item(self) -> dict:
        """The item as input_items lists it back (without id)."""
        if self.type == "function_call":
            return {"type": "function_call", "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {"type": "function_call_output", "call_id": self.call_id, "output": self.output}
        if self.type == "compaction":
            return {"type": "compaction", "encrypted_content": self.encrypted_content}
        if self.type == "reasoning":
            return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": self.text()}]}
        part = "output_text" if self.role == "assistant" else "input_text"
        return {"type": "message", "role": self.role, "content": [{"type": part, "text": self.text()}]}

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionToolParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: NonEmptyText
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: NonEmptyText


# A prompt_cache_retention needs a prompt_cache_key (check() refuses one without).
_RETENTION_NEEDS_KEY = {
    "if": {"required": ["prompt_cache_retention"], "properties": {"prompt_cache_retention": {"type": "string"}}},
    "then": {"required": ["prompt_cache_key"], "properties": {"prompt_cache_key": {"type": "string"}}}}


class ContextManagement(BaseModel):
    """A `context_management` entry: compaction once the input passes `compact_threshold` tokens."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["compaction"]
    compact_threshold: Integer | None = bounded(minimum=1)


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: NonEmptyText


def last_compaction(items: Any) -> tuple[str | None, list["InputMessage"]]:
    """(the encrypted_content of the last compaction item or None, the items after it): a compaction item
    stands for everything before it."""
    if isinstance(items, str):
        return None, []
    for n in range(len(items) - 1, -1, -1):
        if items[n].type == "compaction":
            return items[n].encrypted_content, list(items[n + 1:])
    return None, list(items)


class ResponsesRequest(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": [
        _RETENTION_NEEDS_KEY, needs_tools({"anyOf": [{"const": "required"}, {"type": "object"}]})]})

    model: Text | None = None
    input: NonEmptyText | non_empty_list(InputMessage)
    instructions: Text | None = None
    max_output_tokens: Integer | None = bounded(minimum=1)
    temperature: Number | None = bounded(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: Number | None = bounded(exclusiveMinimum=0, maximum=1)
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    service_tier: ServiceTier | None = None  # orders the caller's own requests only (server/core/priority.py)
    # vLLM's extras, as on the other endpoints
    priority: Integer | None = bounded(minimum=PRIORITY_RANGE[0], maximum=PRIORITY_RANGE[1])
    top_k: Integer | None = bounded(minimum=-1)
    min_p: Number | None = bounded(minimum=0, maximum=1)
    repetition_penalty: Number | None = bounded(minimum=REPETITION_PENALTY_RANGE[0],
                                                 maximum=REPETITION_PENALTY_RANGE[1])
    seed: Integer | None = bounded(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    ignore_eos: StrictBool = False
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    # Refused unless empty / off: the model cannot serve them.
    reasoning: dict[str, Any] | None = None
    include: list[Any] | None = None
    text: dict[str, Any] | None = None
    background: StrictBool | None = None
    top_logprobs: Integer | None = None
    context_management: list[ContextManagement] | None = None
    conversation: NonEmptyText | ConversationRef | None = None

    def check(self) -> None:
        """Checks that need no prompt (call before rendering)."""
        refused = [name for name, on in (
            ("include", bool(self.include)),
            ("background", bool(self.background)),
            ("top_logprobs", bool(self.top_logprobs)),
        ) if on]
        if refused:
            raise InvalidRequestError(f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not supported by "
                                      f"this server (text generation only)", param=refused[0])
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise InvalidRequestError(f"metadata has {len(self.metadata)} keys; at most {MAX_METADATA_KEYS}",
                                      param="metadata")
        if self.prompt_cache_retention is not None and self.prompt_cache_key is None:
            raise InvalidRequestError("prompt_cache_retention needs a prompt_cache_key", param="prompt_cache_retention")
        if self.conversation is not None and self.previous_response_id is not None:
            raise InvalidRequestError("conversation and previous_response_id cannot be used together",
                                      param="conversation")

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def compact_threshold(self) -> int | None:
        """The input size past which the server compacts first (`context_management`), or None."""
        thresholds = [entry.compact_threshold for entry in self.context_management or []
                      if entry.compact_threshold is not None]
        return min(thresholds) if thresholds else None

    def reasoning_use(self, template: str | None) -> ReasoningUse:
        """`reasoning.effort` on the model whose chat template is `template` (none: its default)."""
        effort = (self.reasoning or {}).get("effort")
        return ReasoningUse.of(template, None, "low" if effort == "minimal" else effort, param="reasoning")

    def tool_use(self) -> ToolUse:
        tools = [FunctionTool(t.name, t.description, t.parameters if t.parameters is not None else
                              {"type": "object", "properties": {}}, t.strict) for t in self.tools or []]
        if self.tool_choice is None:
            choice = ToolChoice("auto" if tools else "none")
        else:
            choice = ToolChoice("named", self.tool_choice.name) if isinstance(self.tool_choice, NamedFunction) \
                else ToolChoice(self.tool_choice)
        use = ToolUse(tools, choice, self.parallel_tool_calls is not False, text_format_constraint(self.text),
                      output_param="text.format")
        use.check()
        return use

    def to_conversation(self, tool_use: ToolUse, tenant: str | None, earlier_calls: dict[str, str] | None = None,
                        summary: str | None = None, turns: list[Turn] | None = None,
                        variables: dict[str, Any] | None = None) -> Conversation:
        """The request as the prompt builder takes it, the instructions (and the `summary` of a compacted
        history, server/compaction/summary.py) a segment of their own, as a conversation continued by
        previous_response_id tokenizes them (`earlier_calls`: see `turns`; `turns`: in place of the input's;
        `variables`: more template variables, the reasoning switch)."""
        turns = self.turns(earlier_calls or {}) if turns is None else turns
        instructions = compacted_instructions(self.instructions, summary) or ""
        return Conversation(turns, tool_use.tools, instructions=instructions, tenant=tenant, split_instructions=True,
                            param="input", variables=dict(variables or {}))

    def turns(self, earlier_calls: dict[str, str]) -> list[Turn]:
        """The input, API-neutral ("developer" is the system role to a template); a function_call_output must
        answer a call in this input or in `earlier_calls` (call id -> name, the previous response's)."""
        if isinstance(self.input, str):
            return [Turn("user", self.input)]
        turns: list[Turn] = []
        thinking = ""  # a reasoning item's, for the assistant turn after it
        for m in last_compaction(self.input)[1]:
            if m.type == "reasoning":
                thinking += m.text()
            elif m.type == "function_call":
                call = ToolCall(m.call_id, m.name, m.arguments)
                if turns and turns[-1].role == "assistant" and not thinking:
                    turns[-1].tool_calls.append(call)
                else:
                    turns.append(Turn("assistant", "", [call], reasoning=thinking))
                    thinking = ""
            elif m.type == "function_call_output":
                turns.append(Turn("tool", m.output, tool_call_id=m.call_id, name=earlier_calls.get(m.call_id)))
            else:
                turns.append(Turn("system" if m.role == "developer" else m.role, m.text(),
                                  reasoning=thinking if m.role == "assistant" else ""))
                thinking = "" if m.role == "assistant" else thinking
        link_tool_results(turns, "input", earlier_calls)
        return turns

    def input_items(self) -> list[dict]:
        """The input as OpenAI lists it back (input_items), without ids."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return [m.item() for m in self.input]

    @property
    def pin_ttl_s(self) -> float | None:
        """A prompt_cache_key with a prompt_cache_retention pins the prompt (kv/prefix/pins.py) for this long."""
        return TTL_SECONDS[self.prompt_cache_retention] if self.prompt_cache_retention else None

    def sampling_params(self, max_tokens: int, tool_use: ToolUse, reasoning: ReasoningUse | None = None
                        ) -> SamplingParams:
        values: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=self.ignore_eos, seed=self.seed)
        constraint = tool_use.constraint()
        if reasoning is not None:
            constraint = reasoning.gate(constraint)
        if constraint is not None:
            values["structured_outputs"] = constraint
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return sampling_params(values, {"max_tokens": "max_output_tokens"})


_SOMETHING_TO_COMPACT = {"anyOf": [
    {"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in ("input", "previous_response_id")]}


class CompactRequest(NullMeansDefault):
    """`POST /v1/responses/compact`: the history (`input`, and/or a stored `previous_response_id`) to fold
    into one compaction item."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_SOMETHING_TO_COMPACT)

    model: Text | None = None
    input: NonEmptyText | non_empty_list(InputMessage) | None = None
    instructions: Text | None = None
    previous_response_id: Text | None = None

    def check(self) -> None:
        if self.input is None and self.previous_response_id is None:
            raise InvalidRequestError("nothing to compact: give input, previous_response_id or both", param="input")

    def as_request(self) -> ResponsesRequest:
        """The history as a create request reads it (one prompt path for both)."""
        return ResponsesRequest.model_construct(model=self.model, input=self.input if self.input is not None else [],
                                                instructions=self.instructions,
                                                previous_response_id=self.previous_response_id)


class ConversationCreate(NullMeansDefault):
    """`POST /v1/conversations`."""

    model_config = ConfigDict(extra="ignore")

    items: list[InputMessage] | None = None
    metadata: dict[Text, Text] | None = None


class ConversationUpdate(BaseModel):
    """`POST /v1/conversations/{id}`: new metadata (null clears it)."""

    model_config = ConfigDict(extra="ignore")

    metadata: dict[Text, Text] | None


class ConversationItemsCreate(BaseModel):
    """`POST /v1/conversations/{id}/items`."""

    model_config = ConfigDict(extra="ignore")

    items: non_empty_list(InputMessage)
