"""Function tools and tool calls, API-neutral, and the one text layout a call has in a prompt and an output.

A call is written `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>` (the Hermes / Qwen
layout), calls one after another separated by a newline. The grammar (tools/grammar.py) fixes every
byte of it but ARGS, and ARGS is kept as the exact text the model generated, so rendering a stored
call back into the next turn's prompt gives the text that was generated: the cache holds across turns.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.tools.layouts import HERMES, CallLayout

# The default (Hermes) layout's fixed text around a call's name and arguments (tools/layouts.py).
CALL_OPEN = HERMES.opener
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = HERMES.separator
NAME_PREFIX = HERMES.name_prefix
ARGUMENTS_PREFIX = HERMES.arguments_prefix
CALL_SUFFIX = HERMES.suffix


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: its name, description and JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidRequestError("a function tool needs a non-empty name", param="tools")
        if not isinstance(self.parameters, dict):
            raise InvalidRequestError(f"the parameters of tool {self.name!r} must be a JSON schema object",
                                      param="tools")

    def openai(self) -> dict[str, Any]:
        """The definition as OpenAI's chat API and Hugging Face chat templates spell it (keys in this order)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call: its id, the function's name and the arguments as the exact JSON text generated."""

    id: str
    name: str
    arguments: str

    def text(self, layout: CallLayout = HERMES) -> str:
        """The call as the model writes it in `layout` (and as the next prompt shows it)."""
        return layout.call_text(self.name, self.arguments)

    def arguments_object(self) -> Any:
        """The arguments parsed (chat templates and Anthropic's `input` take an object)."""
        try:
            return json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError:
            raise InvalidRequestError(f"the arguments of tool call {self.id!r} are not valid JSON: "
                                      f"{self.arguments[:80]!r}", param="messages") from None


def new_call_id(prefix: str = "call_") -> str:
    """A fresh call id, OpenAI's shape (`call_...`); Anthropic's are `toolu_...`."""
    return prefix + uuid.uuid4().hex[:24]


def calls_text(calls: list[ToolCall], layout: CallLayout = HERMES) -> str:
    """Several calls as one assistant output writes them."""
    if not calls:
        return ""
    return layout.list_open + layout.separator.join(call.text(layout) for call in calls) + layout.list_close


def dumps(value: Any) -> str:
    """JSON text that is the same for the same value every time: keys in the order given (never sorted,
    a client's order is its own), fixed separators, Unicode kept."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
