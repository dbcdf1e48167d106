"""Every API's way of asking for structured output, mapped to one StructuredOutputsParams.

- OpenAI chat / completions `response_format`: {"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict"}};
- Responses `text.format`: {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"};
- vLLM's `structured_outputs` (completions and chat): one of json / regex / choice / grammar / json_object.
A schema is checked here for its shape (an object, or its JSON text); whether the grammar engine can
compile it is the engine's check (InvalidRequestError -> 400 as well).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvserve.errors import InvalidRequestError
from kvserve.server.core.fields import NonEmptyText, Text, non_empty_list, required_when
from kvserve.structured.params import StructuredOutputsParams

_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _given(kind: str) -> dict:
    value = {"const": True} if kind == "json_object" else {"not": {"type": "null"}}
    return {"required": [kind], "properties": {kind: value}}


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (its other options are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True,
                              json_schema_extra={"oneOf": [_given(kind) for kind in _VLLM_KINDS]})

    json_: dict[str, Any] | NonEmptyText | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: non_empty_list(NonEmptyText) | None = None
    grammar: NonEmptyText | None = None
    json_object: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | StrictBool = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (chat completions, completions)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "allOf": required_when("type", {"json_schema": ("json_schema",)})})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def json_schema(schema: Any, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text, as an object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}",
                                  param=param)
    return schema


def response_format_constraint(response_format: ResponseFormat | dict | None, param: str = "response_format"
                               ) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` (chat completions, completions)."""
    if not response_format:
        return None
    if isinstance(response_format, BaseModel):
        response_format = response_format.model_dump(by_alias=True, exclude_none=True)
    kind = response_format.get("type", "text")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format json_schema needs `json_schema` with a `schema`",
                                      param=f"{param}.json_schema")
        return StructuredOutputsParams(json=json_schema(spec["schema"], f"{param}.json_schema.schema"))
    return _simple_format(kind, param)


def text_format_constraint(text: dict | None, param: str = "text.format") -> StructuredOutputsParams | None:
    """The Responses API's `text.format`."""
    fmt = (text or {}).get("format") or {}
    if not isinstance(fmt, dict):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    kind = fmt.get("type", "text")
    if kind == "json_schema":
        if "schema" not in fmt:
            raise InvalidRequestError(f"{param} json_schema needs a `schema`", param=f"{param}.schema")
        return StructuredOutputsParams(json=json_schema(fmt["schema"], f"{param}.schema"))
    return _simple_format(kind, param)


def _simple_format(kind: Any, param: str) -> StructuredOutputsParams | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    raise InvalidRequestError(f"{param} type {kind!r} is not supported (text, json_object or json_schema)",
                              param=f"{param}.type")


def vllm_structured_outputs(spec: StructuredOutputsField | dict | None, param: str = "structured_outputs"
                            ) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` request field: exactly one of json / regex / choice / grammar / json_object."""
    if spec is None:
        return None
    if isinstance(spec, BaseModel):
        spec = spec.model_dump(by_alias=True)
    given = [kind for kind in _VLLM_KINDS if spec.get(kind) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(f"{param} needs exactly one of {', '.join(_VLLM_KINDS)}, got "
                                  f"{', '.join(given) or 'none'}", param=param)
    kind, value = given[0], spec[given[0]]
    if kind == "json":
        return StructuredOutputsParams(json=json_schema(value, f"{param}.json"))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{param}.choice must be a non-empty list of strings", param=f"{param}.choice")
        return StructuredOutputsParams(choice=list(value))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param}.{kind} must be a non-empty string", param=f"{param}.{kind}")
    return StructuredOutputsParams(**{kind: value})


def one_constraint(*constraints: tuple[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    """The one constraint a request gave under any of its names; two at once is a 400 naming the second."""
    given = [(name, c) for name, c in constraints if c is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"{given[0][0]} and {given[1][0]} cannot both constrain the output",
                                  param=given[1][0])
    return given[0][1] if given else None
