"""OpenAI Responses API request bodies (`POST /v1/responses`) and their SamplingParams.

Type errors are pydantic's (-> 400); ranges are SamplingParams' own. What the
model cannot serve — tools, reasoning, images, files, other item types,
structured output, background mode, server-side conversations — is refused
by name, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from kvserve.engine.sampling import MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, SEED_RANGE, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.pins import TTL_SECONDS
from kvserve.server.core.fields import (Integer, NonEmptyText, NullMeansDefault, Number, Text, bounded,
                                     non_empty_list, required_in_schema, sampling_params)

_TEXT_PART_TYPES = ("input_text", "output_text", "text")
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


class InputMessage(BaseModel):
    """An input item. Only messages are served (no function calls, reasoning items, references)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=required_in_schema("role", "content"))

    type: Text = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Text | list[InputContent] | None = None

    @model_validator(mode="after")
    def _message_only(self) -> "InputMessage":
        if self.type != "message":
            raise PydanticCustomError("unsupported_item", "{item_type} input items are not supported (messages only)",
                                      {"item_type": self.type})
        if self.role is None or self.content is None:
            raise PydanticCustomError("missing_field", "a message needs `role` and `content`")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# A prompt_cache_retention needs a prompt_cache_key (check() refuses one without).
_RETENTION_NEEDS_KEY = {
    "if": {"required": ["prompt_cache_retention"], "properties": {"prompt_cache_retention": {"type": "string"}}},
    "then": {"required": ["prompt_cache_key"], "properties": {"prompt_cache_key": {"type": "string"}}}}


class ResponsesRequest(NullMeansDefault):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_RETENTION_NEEDS_KEY)

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
    # vLLM's extras, as on the other endpoints
    top_k: Integer | None = bounded(minimum=-1)
    min_p: Number | None = bounded(minimum=0, maximum=1)
    repetition_penalty: Number | None = bounded(minimum=REPETITION_PENALTY_RANGE[0],
                                                 maximum=REPETITION_PENALTY_RANGE[1])
    seed: Integer | None = bounded(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    ignore_eos: StrictBool = False
    # Refused unless empty / off: the model cannot serve them.
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[Any] | None = None
    text: dict[str, Any] | None = None
    background: StrictBool | None = None
    conversation: Any = None
    top_logprobs: Integer | None = None

    def check(self) -> None:
        """Checks that need no prompt (call before rendering)."""
        refused = [name for name, on in (
            ("tools", bool(self.tools)),
            ("tool_choice", self.tool_choice not in (None, "none", "auto")),
            ("reasoning", self.reasoning is not None and self.reasoning.get("effort") not in (None, "none")),
            ("include", bool(self.include)),
            ("background", bool(self.background)),
            ("conversation", self.conversation is not None),
            ("top_logprobs", bool(self.top_logprobs)),
        ) if on]
        if refused:
            raise InvalidRequestError(f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not supported by "
                                      f"this server (text generation only)", param=refused[0])
        text_format = (self.text or {}).get("format") or {}
        if text_format.get("type", "text") != "text":
            raise InvalidRequestError(f"text.format type {text_format.get('type')!r} is not supported (only 'text')",
                                      param="text.format")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise InvalidRequestError(f"metadata has {len(self.metadata)} keys; at most {MAX_METADATA_KEYS}",
                                      param="metadata")
        if self.prompt_cache_retention is not None and self.prompt_cache_key is None:
            raise InvalidRequestError("prompt_cache_retention needs a prompt_cache_key", param="prompt_cache_retention")

    def messages(self) -> list[dict[str, str]]:
        """The input as template messages ("developer" is the system role to a template)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.input]

    def input_items(self) -> list[dict]:
        """The input as OpenAI lists it back (input_items), without ids."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        items = []
        for m in self.input:
            part = "output_text" if m.role == "assistant" else "input_text"
            items.append({"type": "message", "role": m.role, "content": [{"type": part, "text": m.text()}]})
        return items

    @property
    def pin_ttl_s(self) -> float | None:
        """A prompt_cache_key with a prompt_cache_retention pins the prompt (kv/pins.py) for this long."""
        return TTL_SECONDS[self.prompt_cache_retention] if self.prompt_cache_retention else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        values: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=self.ignore_eos, seed=self.seed)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return sampling_params(values, {"max_tokens": "max_output_tokens"})
