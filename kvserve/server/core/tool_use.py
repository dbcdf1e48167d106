"""A request's tools, API-neutral: the prompt they render into, the constraint on the output, the calls
parsed back out. Each API maps its own shapes (OpenAI's `tools` / `tool_choice`, Anthropic's
`tool_use` blocks, Responses' `function_call` items) to `FunctionTool`, `ToolChoice` and `Turn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.calls import FunctionTool
from kvserve.tools.grammar import ToolChoice, tool_call_constraint
from kvserve.tools.layouts import HERMES, CallLayout, layout_for_template
from kvserve.tools.parsing import ToolCallParser
from kvserve.tools.rendering import Turn


@dataclass
class ToolUse:
    tools: list[FunctionTool] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True
    output: StructuredOutputsParams | None = None  # response_format / text.format / structured_outputs
    call_id_prefix: str = "call_"
    output_param: str = "response_format"  # the request field `output` came from
    # How the model writes calls: its chat template's layout (layout_for_template), which the grammar forces
    # and the parser reads, so a call renders back into the next prompt as generated. HERMES: kvserve's block.
    layout: CallLayout = HERMES
    # The vocabulary's special tokens in the layout's fixed text (text -> id: Mistral's `[TOOL_CALLS]`, harmony's
    # `<|call|>`), which the grammar writes as those tokens.
    special_tokens: dict[str, int] = field(default_factory=dict)

    def with_template(self, template: str | None, special_tokens: dict[str, int] | None = None) -> "ToolUse":
        """This request's tools with the call layout `template` writes history calls in (`special_tokens`: the
        vocabulary's, text -> id; those in the layout's text are kept)."""
        self.layout = layout_for_template(template) if self.tools else HERMES  # (unknown layouts refuse tools only)
        fixed = "".join(self.markers())
        self.special_tokens = {text: i for text, i in (special_tokens or {}).items() if text and text in fixed}
        return self

    def markers(self) -> tuple[str, ...]:
        """The fixed text of the layout's calls (what the parser must see in the output)."""
        layout = self.layout
        return tuple(text for text in (layout.list_open, layout.opener, layout.arguments_prefix, layout.suffix,
                                       layout.list_close) if text.strip())

    @property
    def constraint_param(self) -> str:
        """The request field a constraint that does not compile is blamed on: the tools' schemas, or the
        output format the request gave."""
        return "tools" if self.parses_calls else self.output_param

    def check(self, param: str = "tool_choice") -> None:
        names = [tool.name for tool in self.tools]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise InvalidRequestError(f"tools define {', '.join(duplicated)} more than once", param="tools")
        if self.tools:
            self.choice.check(self.tools, param)
        elif self.choice.mode in ("required", "named"):
            raise InvalidRequestError(f"tool_choice {self.choice.mode!r} needs tools", param=param)

    @property
    def parses_calls(self) -> bool:
        """Whether the output may hold calls (so it is parsed for them)."""
        return bool(self.tools) and self.choice.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """What the engine constrains the output to: the calls the choice demands, or the structured output;
        under tool_choice "none" (without one) text that never opens a call."""
        if self.choice.mode == "none" and self.output is None:
            return tool_call_constraint(self.tools, self.choice, layout=self.layout, special=self.special_tokens)
        if not self.parses_calls:
            return self.output
        answer = None
        if self.output is not None and self.choice.mode == "auto":
            if self.output.json is None and not self.output.json_object:
                raise InvalidRequestError("with tools, only a JSON structured output can be asked for",
                                          param="response_format")
            # a dict: the server's mapping (structured_output.py) parses schemas given as text
            answer = self.output.json if self.output.json is not None else {"type": "object"}
        return tool_call_constraint(self.tools, self.choice, self.parallel, answer, self.layout, self.special_tokens)

    def parser(self) -> ToolCallParser | None:
        """The output's parser (None: no calls to look for). Under "required" or a named function the output
        is calls from its first token, so a call cut short is never content."""
        if not self.parses_calls:
            return None
        return ToolCallParser(self.call_id_prefix, self.layout, calls_only=self.choice.mode in ("required", "named"))


def link_tool_results(turns: list[Turn], param: str = "messages", earlier: dict[str, str] | None = None) -> None:
    """Every tool result must answer a call made earlier in the conversation (or in `earlier`: call id -> name,
    calls of a previous response); its function's name is filled in."""
    names: dict[str, str] = dict(earlier or {})
    for position, turn in enumerate(turns):
        for call in turn.tool_calls:
            names[call.id] = call.name
        if turn.role != "tool":
            continue
        if turn.tool_call_id not in names:
            raise InvalidRequestError(
                f"{param}[{position}] is a tool result for call id {turn.tool_call_id!r}, but no earlier call has "
                f"that id", param=param)
        turn.name = turn.name or names[turn.tool_call_id]
