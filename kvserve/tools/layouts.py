"""The text layout of tool calls in an output (and in the history a chat template renders back).

A layout is the fixed text around each call's name and arguments:
`list_open + (opener + name_prefix + NAME + arguments_prefix + ARGS + suffix)` joined by `separator`,
then `list_close`. NAME is the function's name as a JSON string (or bare, where the layout writes it so:
Mistral's `[TOOL_CALLS]NAME[ARGS]`, harmony's `to=functions.NAME`), ARGS the arguments as the JSON text
generated. The grammar (tools/grammar.py) forces every byte of it but ARGS, the parser (tools/parsing.py)
reads it back, and ToolCall.text() writes it, so a call the model made is rendered into the next prompt as
the text it generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.errors import InvalidRequestError


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
    quoted_name: bool = True  # the name as a JSON string (False: bare, as a function's name is written)

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

    def name_text(self, name: str) -> str:
        """A function's name as the layout writes it."""
        return json.dumps(name, ensure_ascii=False) if self.quoted_name else name

    def call_text(self, name: str, arguments: str) -> str:
        """One call (without the list's opening and closing)."""
        return self.opener + self.name_prefix + self.name_text(name) + self.arguments_prefix + arguments + self.suffix

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


# Mistral's v11+ tokenizers (Ministral 3, Mistral Small 3.2, Devstral): `[TOOL_CALLS]NAME[ARGS]ARGS` per call, the
# name bare, calls one after another.
MISTRAL_ARGS = CallLayout("mistral_args", opener="[TOOL_CALLS]", name_prefix="", arguments_prefix="[ARGS]", suffix="",
                          separator="", quoted_name=False)

# Phi-4-mini (llama.cpp's template, which renders calls back): `<|tool_call|>{"name": "NAME", "arguments": ARGS}<|/tool_call|>`.
PHI4 = CallLayout("phi4", opener="<|tool_call|>", name_prefix='{"name": ', arguments_prefix=', "arguments": ',
                  suffix="}<|/tool_call|>", separator="")

# gpt-oss (harmony): a call is a commentary message addressed to the function,
# `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`; `<|call|>` ends the output, so
# one call a turn. (Its template renders a history call in another order, `to=` before the channel: the next
# prompt does not hold the call as generated.)
HARMONY = CallLayout("harmony", opener="<|channel|>commentary to=functions.", name_prefix="",
                     arguments_prefix=" <|constrain|>json<|message|>", suffix="<|call|>", separator="",
                     parallel=False, quoted_name=False)

LAYOUTS = (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, PHI4, HARMONY)


class UnknownToolLayout:
    """A chat template that renders tools, in a layout kvserve does not know: a request with tools is refused
    (its calls could be neither forced nor read back), one without tools is served as usual."""

    name = "unknown"

    def refuse(self) -> CallLayout:
        raise InvalidRequestError(
            "the model's chat template renders tools in a call layout kvserve does not know (known: "
            f"{', '.join(layout.name for layout in LAYOUTS)}), so its calls could not be read: send the request "
            "without tools, or serve the model with a template in a known layout", param="tools")


def detect_layout(template: str | None) -> CallLayout | UnknownToolLayout:
    """The call layout a chat template writes history calls in, recognised from its source: HERMES for templates
    that do not render tools (kvserve's default block uses it), UnknownToolLayout for one that renders them in a
    layout not known here."""
    if not template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if "[ARGS]" in template else MISTRAL
    if "<|tool_call|>" in template:
        return PHI4
    if "to=functions." in template or '"functions." + tool_call.name' in template:
        return HARMONY
    if '"parameters": ' in template and ("<|eot_id|>" in template or "<|eom_id|>" in template):
        return LLAMA3_JSON
    if "<tool_call>" in template or "tools" not in template:
        return HERMES
    return UnknownToolLayout()


def layout_for_template(template: str | None) -> CallLayout:
    """The call layout of `template` (detect_layout); a template that renders tools in an unknown layout is a
    400 naming `tools`."""
    layout = detect_layout(template)
    return layout.refuse() if isinstance(layout, UnknownToolLayout) else layout
