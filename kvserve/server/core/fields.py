"""Request field types every API's body shares: strict numbers, valid Unicode text, documented bounds,
`null` as the default, and sampling errors that name the request's own field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, StrictFloat, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError

def _integral(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer (the schema says "integer"), so the server does too;
    # 1.5, "1" and true stay type errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Strict integers, but 2.0 is 2 (as JSON Schema has it).
Integer = Annotated[StrictInt, BeforeValidator(_integral)]
# Strict numbers: "0.7" (a string) is a type error, as in OpenAI's API; ints are accepted as floats.
Number = StrictFloat | StrictInt
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(value: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"); Python keeps it, but no tokenizer or UTF-8
    # encoder accepts it. Refuse it here, where the error can name the field.
    if not value.isascii() and (match := _LONE_SURROGATE.search(value)):
        raise PydanticCustomError(
            "lone_surrogate", "contains a lone surrogate (U+{code}) at character {position}: not valid Unicode text",
            {"code": f"{ord(match.group()):04X}", "position": match.start()})
    return value


# Every string a request carries.
Text = Annotated[str, AfterValidator(_valid_text)]


def bounded(default: Any = None, **bounds: Any) -> Any:
    """A field whose range is documented in the OpenAPI schema (JSON Schema keywords) and enforced
    by SamplingParams or the API's own checks, which word the errors the same way for the offline API."""
    return Field(default, json_schema_extra=bounds)


def _non_empty(value: Any) -> Any:
    if len(value) == 0:
        raise PydanticCustomError("empty", "must not be empty")
    return value


# Text that must not be empty: the schema says so (minLength), the check says "must not be empty".
NonEmptyText = Annotated[Text, AfterValidator(_non_empty), Field(json_schema_extra={"minLength": 1})]


def non_empty_list(item: Any) -> Any:
    """A list of `item` that must not be empty (the schema's minItems)."""
    return Annotated[list[item], AfterValidator(_non_empty), Field(json_schema_extra={"minItems": 1})]


class NullMeansDefault(BaseModel):
    """A request body where an explicit `null` is the field's default, as OpenAI's spec makes these
    fields nullable and wrappers (langchain, litellm, ...) pass `None` through. A field takes part
    when its type allows None and its default is not None; the schema then says `nullable`."""

    @model_validator(mode="after")
    def _null_means_default(self):
        for name, info in type(self).model_fields.items():
            if info.default is not None and getattr(self, name) is None:
                setattr(self, name, info.get_default(call_default_factory=True))
        return self


def sampling_params(values: Mapping[str, Any], renamed: Mapping[str, str]) -> SamplingParams:
    """SamplingParams(**values), its errors naming the request's own field: `renamed` maps a
    SamplingParams name to the field the request spelled it as (max_tokens -> max_output_tokens)."""
    try:
        return SamplingParams(**values)
    except InvalidRequestError as exc:
        field = renamed.get(exc.param or "")
        if field is None:
            raise
        message = str(exc)
        if message.startswith(exc.param):
            message = field + message[len(exc.param):]
        raise InvalidRequestError(message, param=field) from None


def required_in_schema(*names: str):
    """`json_schema_extra` for a model whose fields `names` the schema requires, non-null, although the
    model lets them be absent so that its own check can say what is wrong instead (an image part has
    no `text`: "images are not supported" says more than "`text` is required")."""

    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = sorted(set(schema.get("required", [])) | set(names))
        for name in names:
            prop = schema["properties"][name]
            if "anyOf" in prop:
                prop["anyOf"] = [option for option in prop["anyOf"] if option.get("type") != "null"]
            prop.pop("default", None)

    return extra


def required_when(field: str, requirements: Mapping[str, tuple[str, ...]], default: str | None = None) -> list[dict]:
    """Schema rules (for an `allOf`) of an object whose kind is `field`: each kind requires its own fields,
    non-null (`default`: the kind when `field` is absent)."""
    rules = []
    for value, names in requirements.items():
        condition: dict[str, Any] = {"properties": {field: {"const": value}}}
        if value != default:
            condition["required"] = [field]
        rules.append({"if": condition, "then": {"required": list(names),
                                                "properties": {n: {"not": {"type": "null"}} for n in names}}})
    return rules


def needs_tools(choice_rule: dict) -> dict:
    """A schema rule: a tool_choice matching `choice_rule` (one that demands a call) needs tools."""
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": choice_rule}},
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


def check_typed_fields(model: BaseModel, table: Mapping[str, tuple[str, ...]], noun: str, code: str) -> None:
    """A part whose `type` picks the fields it must carry (an Anthropic content block, a Responses input
    item): an unknown type, or a known one missing a field, is a validation error naming them."""
    if model.type not in table:
        raise PydanticCustomError(code, "{part_type} {noun} are not supported ({known})",
                                  {"part_type": model.type, "noun": noun, "known": ", ".join(table)})
    missing = [name for name in table[model.type] if getattr(model, name) is None]
    if missing:
        raise PydanticCustomError("missing_field", "a {part_type} {noun} needs {fields}",
                                  {"part_type": model.type, "noun": noun.removesuffix("s"),
                                   "fields": ", ".join(f"`{m}`" for m in missing)})
