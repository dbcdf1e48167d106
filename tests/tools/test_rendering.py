"""Tools into prompts: the default block, the model's own template, byte stability."""

import json

from kvserve.tools.calls import FunctionTool, ToolCall
from kvserve.tools.rendering import (DEFAULT_TOOLS_PREAMBLE, Turn, default_tools_block, render_conversation,
                                     template_supports_tools)
from tests.server.inprocess import CHATML

WEATHER = FunctionTool("get_weather", "Weather of a city",
                       {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                        "required": ["city"]})
CLOCK = FunctionTool("now", None, {"type": "object", "properties": {}})
TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:"
                  "{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.name }} "
                  "{{ c.function.arguments | tojson }}]{% endfor %}\n{% endfor %}")
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
HISTORY = [Turn("system", "Be brief."), Turn("user", "Weather in Paris?"), Turn("assistant", "", [CALL]),
           Turn("tool", "sunny", tool_call_id="call_1"), Turn("tool", "20C", tool_call_id="call_1")]


def test_the_default_block_lists_each_tool_as_one_json_line_in_the_given_key_order():
    block = default_tools_block([WEATHER, CLOCK])
    assert block.startswith(DEFAULT_TOOLS_PREAMBLE)
    lines = block[len(DEFAULT_TOOLS_PREAMBLE):].split("\n</tools>")[0].split("\n")
    assert [json.loads(line)["function"]["name"] for line in lines] == ["get_weather", "now"]
    assert lines[0].startswith('{"type": "function", "function": {"name": "get_weather", "description": ')
    assert '"properties": {"city": {"type": "string"}, "unit"' in lines[0]  # the client's order, never sorted
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in block


def test_a_template_without_tools_gets_the_default_block_calls_and_responses():
    assert not template_supports_tools(CHATML)
    messages, variables = render_conversation(HISTORY, [WEATHER], CHATML)
    assert variables == {}
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert messages[2] == {"role": "assistant", "content": CALL.text()}
    assert CALL.text() == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # consecutive results share one user turn
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                        "<tool_response>\n20C\n</tool_response>"}
    assert len(messages) == 4


def test_without_a_system_message_the_block_is_one():
    messages, _ = render_conversation([Turn("user", "hi")], [CLOCK], CHATML)
    assert messages[0]["role"] == "system" and messages[0]["content"] == default_tools_block([CLOCK])


def test_a_template_with_tools_renders_them_itself():
    from kvserve.model.tokenizer import _compile_template

    assert template_supports_tools(TOOLS_TEMPLATE)
    messages, variables = render_conversation(HISTORY, [WEATHER], TOOLS_TEMPLATE)
    assert variables == {"tools": [WEATHER.openai()]}
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    text = _compile_template(TOOLS_TEMPLATE).render(messages=messages, **variables)
    assert 'TOOLS:[{"type": "function"' in text and '[get_weather {"city": "Paris"}]' in text


def test_rendering_is_byte_stable_and_changes_with_the_tools():
    first = render_conversation(HISTORY, [WEATHER, CLOCK], CHATML)
    again = render_conversation([Turn(**vars(t)) for t in HISTORY], [WEATHER, CLOCK], CHATML)
    assert json.dumps(first) == json.dumps(again)
    reordered = render_conversation(HISTORY, [CLOCK, WEATHER], CHATML)
    assert json.dumps(first) != json.dumps(reordered)


def test_an_assistant_turn_with_text_and_calls_renders_as_generated():
    turn = Turn("assistant", "Let me check.", [CALL, ToolCall("call_2", "now", "{}")])
    messages, _ = render_conversation([Turn("user", "u"), turn], [WEATHER, CLOCK], CHATML)
    assert messages[-1]["content"] == ("Let me check.<tool_call>\n" '{"name": "get_weather", "arguments": '
                                       '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "now", '
                                       '"arguments": {}}\n</tool_call>')
