"""The grammar a tool call follows (llguidance Lark, each function's arguments as `%json{schema}`).

The grammar spells a call layout (tools/layouts.py, HERMES unless told) byte for byte, so a constrained
call always parses and renders back to the same text. tool_choice:
- "required": one or more calls (exactly one when parallel calls are off), nothing else;
- a named function: exactly one call of it;
- "auto": free text until the model writes `<tool_call>` (the trigger), then the rest is calls;
- "none": free text without `<tool_call` (a token ban, structured/excluded.py).
After the last call only the end of the output may follow (the engine allows EOS alone once the
grammar is complete).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.calls import FunctionTool
from kvserve.tools.layouts import HERMES, CallLayout

# Arguments in the separators json.dumps and chat templates' `tojson` use, no other whitespace: the
# text generated is the text a template would write for the same object.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolChoice:
    """Whether and which tools the model must call: "auto", "none", "required", or "named" (`name`)."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None

    def check(self, tools: list[FunctionTool], param: str = "tool_choice") -> None:
        """Refuse a choice the tools cannot satisfy (400 naming `param`)."""
        if self.mode in ("required", "named") and not tools:
            raise InvalidRequestError(f"tool_choice {self.mode!r} needs tools", param=param)
        if self.mode == "named" and self.name not in {tool.name for tool in tools}:
            raise InvalidRequestError(f"tool_choice names the function {self.name!r}, which is not among the tools "
                                      f"({', '.join(tool.name for tool in tools)})", param=param)


def _literal(text: str, special: Mapping[str, int] | None = None) -> str:
    """`text` as Lark items: a string, with each of the vocabulary's special tokens in it (`special`: text -> id,
    Mistral's `[TOOL_CALLS]`, harmony's `<|call|>`) as that token, which a quoted string never matches."""
    found = [name for name in special or {} if name in text]
    if not found:
        return json.dumps(text, ensure_ascii=False)
    pattern = "(" + "|".join(re.escape(name) for name in sorted(found, key=len, reverse=True)) + ")"
    items = [f"<[{special[part]}]>" if part in special else json.dumps(part, ensure_ascii=False)
             for part in re.split(pattern, text) if part]
    return " ".join(items)


def _arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    """The tool's parameters schema as the grammar applies it: a call's arguments are the properties the
    schema names unless it says otherwise (`additionalProperties`); a small model otherwise invents
    more until max_tokens."""
    schema = dict(tool.parameters) if tool.parameters else {"type": "object"}
    schema.setdefault("type", "object")
    if "properties" in schema:
        schema.setdefault("additionalProperties", False)
    schema["x-guidance"] = {**_JSON_LAYOUT, **schema.get("x-guidance", {})}
    return schema


def call_grammar(tools: list[FunctionTool], layout: CallLayout = HERMES, special: Mapping[str, int] | None = None
                 ) -> list[str]:
    """Lark rules `call` (one call in `layout`, without the list's opening) and one `args_i` per tool."""
    alternatives, rules = [], []
    for i, tool in enumerate(tools):
        head = layout.next_head + _name_head(tool, layout)
        alternatives.append(_sequence(_literal(head, special), f"args_{i}", _literal(layout.suffix, special)))
        rules.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool), ensure_ascii=False)}")
    return ["call: " + " | ".join(alternatives), *rules]


def _sequence(*parts: str) -> str:
    """Lark items in a row, empty literals left out."""
    return " ".join(part for part in parts if part and part != '""')


def tool_call_constraint(tools: list[FunctionTool], choice: ToolChoice, parallel: bool = True,
                         answer_schema: dict[str, Any] | None = None, layout: CallLayout = HERMES,
                         special: Mapping[str, int] | None = None) -> StructuredOutputsParams | None:
    """The constraint for `choice` over `tools` in `layout` (None: no tools, the output is free). With
    `answer_schema` (structured output asked for as well), "auto" is that JSON or calls, no free text. "none" is
    free text that never opens a call (the tools stay in the prompt, so the model knows the layout and would
    write it). `special`: the vocabulary's special tokens in the layout's text (text -> id), written as tokens."""
    if not tools:
        return None
    if choice.mode == "none":  # (without its last character: a model kept from `<tool_call>` wrote `<tool_call]`)
        return StructuredOutputsParams(excluded_text=layout.trigger[:-1] or layout.trigger)
    choice.check(tools)
    if choice.mode == "named":
        tools = [tool for tool in tools if tool.name == choice.name]
        parallel = False
    parallel = parallel and layout.parallel
    more = f"({_sequence(_literal(layout.separator, special), 'call')})*" if parallel else ""
    close = _literal(layout.list_close, special) if layout.list_close else ""
    rules = call_grammar(tools, layout, special)
    calls = _sequence(_literal(layout.list_open, special), "call", more, close)
    if choice.mode == "auto" and answer_schema is not None:
        answer = f"answer: %json {json.dumps(answer_schema, ensure_ascii=False)}"
        return StructuredOutputsParams(grammar="\n".join([f"start: answer | {calls}", answer, *rules]))
    if choice.mode == "auto":  # the trigger is already written when the grammar starts: the rest of the first call
        rest = (layout.list_open + layout.next_head)[len(layout.trigger):]
        firsts = [_sequence(_literal(rest + _name_head(tool, layout), special), f"args_{i}",
                            _literal(layout.suffix, special))
                  for i, tool in enumerate(tools)]
        grammar = [f"start: {_sequence('first', more, close)}", "first: " + " | ".join(firsts), *rules]
        return StructuredOutputsParams(grammar="\n".join(grammar), trigger=layout.trigger)
    return StructuredOutputsParams(grammar="\n".join([f"start: {calls}", *rules]))


def _name_head(tool: FunctionTool, layout: CallLayout) -> str:
    return layout.name_text(tool.name) + layout.arguments_prefix
