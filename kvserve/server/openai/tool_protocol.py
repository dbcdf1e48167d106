"""OpenAI's tool shapes in chat completions: `tools`, `tool_choice`, assistant `tool_calls`, and how a
request's fields become a ToolUse (server/core/tool_use.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool

from kvserve.server.core.fields import NonEmptyText, Text
from kvserve.server.core.structured_output import (ResponseFormat, StructuredOutputsField, one_constraint,
                                                   response_format_constraint, vllm_structured_outputs)
from kvserve.server.core.tool_use import ToolUse
from kvserve.tools.calls import FunctionTool, ToolCall
from kvserve.tools.grammar import ToolChoice


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: NonEmptyText
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition

    def definition(self) -> FunctionTool:
        f = self.function
        parameters = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        return FunctionTool(f.name, f.description, parameters, f.strict)


class FunctionName(BaseModel):
    name: NonEmptyText


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: NonEmptyText
    arguments: Text = "{}"


class ChatToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")

    id: NonEmptyText
    type: Literal["function"] = "function"
    function: CalledFunction

    def call(self) -> ToolCall:
        return ToolCall(self.id, self.function.name, self.function.arguments)


ChatToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


def tool_choice(value: ChatToolChoice | None, has_tools: bool) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if value is None:
        return ToolChoice("auto" if has_tools else "none")
    if isinstance(value, NamedToolChoice):
        return ToolChoice("named", value.function.name)
    return ToolChoice(value)


def chat_tool_use(tools: list[ChatTool] | None, choice: ChatToolChoice | None, parallel: bool | None,
                  response_format: ResponseFormat | None, structured_outputs: StructuredOutputsField | None) -> ToolUse:
    definitions = [tool.definition() for tool in tools or []]
    output = one_constraint(("response_format", response_format_constraint(response_format)),
                            ("structured_outputs", vllm_structured_outputs(structured_outputs)))
    output_param = "structured_outputs" if structured_outputs is not None else "response_format"
    use = ToolUse(definitions, tool_choice(choice, bool(definitions)), parallel is not False, output,
                  output_param=output_param)
    use.check()
    return use
