"""Tool definitions, calls and results into chat-template messages, the same bytes every turn.

A conversation arrives API-neutral (`Turn`s: system / user / assistant with `ToolCall`s / tool results).
A model whose chat template knows tools (its source mentions `tools`) gets them its own way: the
definitions as the template's `tools` variable, calls as `tool_calls` (arguments as objects, as Hugging
Face templates expect), results as `tool` messages. Any other template gets kvserve's default block, in
the Hermes / Qwen style most small instruct models have seen:

- the definitions go at the end of the system message (one is added if there is none), one JSON line
  per tool inside `<tools>` ... `</tools>`, after a short instruction (DEFAULT_TOOLS_PREAMBLE);
- an assistant turn's calls follow its content as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`
  (tools/calls.py), exactly as they were generated;
- results go in a user turn, one `<tool_response>\\n...\\n</tool_response>` per result (consecutive results
  share the turn).

Byte-stable: JSON is written with fixed separators, keys in the order the client gave, never sorted, and
nothing depends on the time or on set order. The same tools in the same order give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.tools.calls import CALL_CLOSE, CALL_OPEN, FunctionTool, ToolCall, calls_text, dumps

DEFAULT_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
DEFAULT_TOOLS_CLOSING = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n' f"{CALL_CLOSE}")
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclass
class Turn:
    """One message of a conversation, whatever API it came from."""

    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None  # tool: the function's name
    # Places in `content` the caller wants found again in tokens (offset, tag): Anthropic's cache_control
    # breakpoints (server/prompt/builder.py).
    marks: list[tuple[int, Any]] = field(default_factory=list)
    reasoning: str = ""  # assistant: its thinking, as the client sent it back (templates that keep it render it)


def template_supports_tools(template: str | None) -> bool:
    """A chat template that renders tools itself mentions its `tools` variable."""
    return bool(template) and "tools" in template


def default_tools_block(tools: list[FunctionTool]) -> str:
    """The system message's tool section for templates without tool support."""
    return DEFAULT_TOOLS_PREAMBLE + "\n".join(dumps(tool.openai()) for tool in tools) + DEFAULT_TOOLS_CLOSING


def system_with_tools(system: str, tools: list[FunctionTool]) -> str:
    """A system message's text with the default block after it (the block alone without one)."""
    block = default_tools_block(tools)
    return f"{system}\n\n{block}" if system else block


def template_variables(tools: list[FunctionTool], template: str | None) -> dict[str, Any]:
    """The template variables for `tools`: `tools` for a template that renders them itself, else none."""
    return {"tools": [tool.openai() for tool in tools]} if tools and template_supports_tools(template) else {}


def tool_response(content: str) -> str:
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def render_conversation(turns: list[Turn], tools: list[FunctionTool], template: str | None
                        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the model's chat template."""
    if template_supports_tools(template):
        return [_template_message(turn) for turn in turns], template_variables(tools, template)
    messages: list[dict[str, Any]] = []
    if tools:
        system = turns[0].content if turns and turns[0].role == "system" else ""
        turns = turns[1:] if turns and turns[0].role == "system" else turns
        messages.append({"role": "system", "content": system_with_tools(system, tools)})
    for turn in turns:
        if turn.role == "tool":
            response = tool_response(turn.content)
            if messages and messages[-1].get("tool_results"):
                messages[-1]["content"] += "\n" + response
            else:
                messages.append({"role": "user", "content": response, "tool_results": True})
        elif turn.role == "assistant":
            messages.append(_with_reasoning({"role": "assistant", "content": turn.content + calls_text(turn.tool_calls)},
                                            turn))
        else:
            messages.append({"role": turn.role, "content": turn.content})
    for message in messages:
        message.pop("tool_results", None)
    return messages, {}


def _with_reasoning(message: dict[str, Any], turn: Turn) -> dict[str, Any]:
    """An assistant message's thinking under the names templates read it by: `reasoning_content` (Qwen3, vLLM's
    name) and `thinking` (gpt-oss). Templates that drop it (most, for turns before the last user message) do."""
    if turn.reasoning:
        message["reasoning_content"] = message["thinking"] = turn.reasoning
    return message


def _template_message(turn: Turn) -> dict[str, Any]:
    message: dict[str, Any] = _with_reasoning({"role": turn.role, "content": turn.content}, turn)
    if turn.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": _template_arguments(call)}}
                                 for call in turn.tool_calls]
    if turn.role == "tool":
        message["tool_call_id"] = turn.tool_call_id
        if turn.name is not None:
            message["name"] = turn.name
    return message


def _template_arguments(call: ToolCall) -> Any:
    """A history call's arguments as a template takes them: the object (Hugging Face templates write it
    with `tojson`), or the text as the client sent it where that is not JSON. The one rule on every path:
    a history call is never refused for its arguments (OpenAI accepts any string there), and the default
    block writes the text as sent too."""
    try:
        return call.arguments_object()
    except InvalidRequestError:
        return call.arguments
