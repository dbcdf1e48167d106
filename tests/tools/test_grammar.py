"""The call grammar: its text for each tool_choice, and refusals."""

import json

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.tools.calls import FunctionTool
from kvserve.tools.grammar import ToolChoice, tool_call_constraint

WEATHER = FunctionTool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}})
CLOCK = FunctionTool("now")


def _json_rules(grammar: str) -> dict[str, dict]:
    return {line.split(":")[0]: json.loads(line.split("%json ", 1)[1]) for line in grammar.splitlines()
            if "%json" in line}


def test_required_is_one_or_more_calls_in_the_fixed_layout():
    spec = tool_call_constraint([WEATHER, CLOCK], ToolChoice("required"))
    lines = spec.grammar.splitlines()
    assert spec.trigger is None
    assert lines[0] == 'start: call ("\\n" call)*'
    assert lines[1] == ('call: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 '
                        '"}\\n</tool_call>" | '
                        '"<tool_call>\\n{\\"name\\": \\"now\\", \\"arguments\\": " args_1 "}\\n</tool_call>"')
    rules = _json_rules(spec.grammar)
    assert rules["args_0"]["properties"] == {"city": {"type": "string"}}
    assert rules["args_0"]["x-guidance"] == {"whitespace_flexible": False, "item_separator": ", ",
                                             "key_separator": ": "}
    assert rules["args_0"]["additionalProperties"] is False  # the named properties only, unless it says
    assert WEATHER.parameters.get("x-guidance") is None  # the tool's own schema is not changed


def test_parallel_off_and_named_are_exactly_one_call():
    assert tool_call_constraint([WEATHER, CLOCK], ToolChoice("required"), parallel=False).grammar.splitlines()[0] \
        == 'start: call'
    named = tool_call_constraint([WEATHER, CLOCK], ToolChoice("named", "now"))
    assert named.grammar.splitlines()[0] == 'start: call' and "get_weather" not in named.grammar


def test_auto_starts_after_the_trigger_and_none_is_free():
    auto = tool_call_constraint([WEATHER], ToolChoice("auto"))
    assert auto.trigger == "<tool_call>" and auto.grammar.startswith('start: first ("\\n" call)*\nfirst: "\\n{')
    assert tool_call_constraint([WEATHER], ToolChoice("none")).excluded_text == "<tool_call"
    assert tool_call_constraint([], ToolChoice("auto")) is None


def test_auto_with_a_structured_answer_is_that_json_or_calls():
    spec = tool_call_constraint([WEATHER], ToolChoice("auto"), answer_schema={"type": "object"})
    assert spec.trigger is None and spec.grammar.startswith('start: answer | call ("\\n" call)*')
    assert _json_rules(spec.grammar)["answer"] == {"type": "object"}


def test_an_unknown_named_function_is_refused():
    with pytest.raises(InvalidRequestError, match="'nope', which is not among the tools") as info:
        tool_call_constraint([WEATHER], ToolChoice("named", "nope"))
    assert info.value.param == "tool_choice"
