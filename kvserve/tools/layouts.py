"""The text layout of tool calls in an output (and in the history a chat template renders back).

A layout is the fixed text around each call's name and arguments:
`list_open + (opener + name_prefix + NAME + arguments_prefix + ARGS + suffix)` joined by `separator`,
then `list_close`. NAME is the function's name as a JSON string, ARGS the arguments as the JSON text
generated. The grammar (tools/grammar.py) forces every byte of it but ARGS, the parser (tools/parsing.py)
reads it back, and ToolCall.text() writes it, so a call the model made is rendered into the next prompt as
the text it generated.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallLayout:
    """How a model writes its calls. `parallel` False: the layout (its chat template) holds one call only."""

    name: str
    opener: str  # starts each call ("" when a call is a bare JSON object)
    name_prefix: str  # between the opener and the function's name
    arguments_prefix: str  # between the name and the arguments
    suffix: str  # after the arguments, closing the call
    separator: str = "\n"  # between parallel calls
    list_open: str = ""  # before the first call
    list_close: str = ""  # after the last call
    parallel: bool = True

    @property
    def trigger(self) -> str:
        """The text that starts the calls of an output: free text before it, calls only from it on (the
        structured-output trigger of tool_choice "auto")."""
        return self.list_open + self.opener or self.name_prefix

    @property
    def first_head(self) -> str:
        """The fixed text of the first call before its name."""
        return self.list_open + self.opener + self.name_prefix

    @property
    def next_marker(self) -> str:
        """What starts each call after the first (after the separator)."""
        return self.opener or self.name_prefix

    @property
    def next_head(self) -> str:
        """The fixed text of a further call before its name (after the separator)."""
        return self.opener + self.name_prefix

    def call_text(self, name_json: str, arguments: str) -> str:
        """One call (without the list's opening and closing)."""
        return self.opener + self.name_prefix + name_json + self.arguments_prefix + arguments + self.suffix

    def is_layout_text(self, text: str) -> bool:
        """Whether text between or after calls is only the layout's (separators, the list's close, whitespace)."""
        for fixed in (self.separator, self.list_close):
            if fixed.strip():
                text = text.replace(fixed.strip(), "")
        return not text.strip()


# `<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`, calls separated by a newline: Hermes and
# Qwen (2.5, 3), and kvserve's default tool block for templates that do not render tools.
HERMES = CallLayout("hermes", opener="<tool_call>", name_prefix='\n{"name": ', arguments_prefix=', "arguments": ',
                    suffix="}\n</tool_call>", separator="\n")

# Llama 3.1+ (JSON tool calling): the whole turn is `{"name": "NAME", "parameters": ARGS}`, then <|eot_id|> (or
# <|eom_id|> with builtin tools): both end the output, as the template ends the call's turn. One call a turn
# (the template refuses more).
LLAMA3_JSON = CallLayout("llama3_json", opener="", name_prefix='{"name": ', arguments_prefix=', "parameters": ',
                         suffix="}", separator="", parallel=False)

# Mistral: `[TOOL_CALLS][{"name": "NAME", "arguments": ARGS}, ...]`. (Templates that add each call's id after
# its arguments write what the model cannot know beforehand: their history is not byte-exact.)
MISTRAL = CallLayout("mistral", opener="", name_prefix='{"name": ', arguments_prefix=', "arguments": ', suffix="}",
                     separator=", ", list_open="[TOOL_CALLS][", list_close="]")


def layout_for_template(template: str | None) -> CallLayout:
    """The call layout a chat template writes history calls in, recognised from its source (HERMES, also for
    templates that do not render tools: kvserve's default block uses it)."""
    if not template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if '"parameters": ' in template and ("<|eot_id|>" in template or "<|eom_id|>" in template):
        return LLAMA3_JSON
    return HERMES
