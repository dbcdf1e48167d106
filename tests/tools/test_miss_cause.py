"""The miss explainer's causes for agent loops."""

import pytest

from kvserve.tools.miss_cause import divergence_cause
from kvserve.tools.rendering import default_tools_block
from kvserve.tools.calls import FunctionTool


def test_a_divergence_inside_the_tools_block_blames_the_tool_definitions():
    block = default_tools_block([FunctionTool("a"), FunctionTool("b")])
    before = "<|im_start|>system\n" + block[:block.index('"b"')]
    assert "tool definitions changed" in divergence_cause(before, 'c"', 'b"')


def test_a_divergence_inside_a_call_blames_its_serialization():
    before = 'user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"a":'
    assert "tool call in the history" in divergence_cause(before, "1", " 1")


def test_a_divergence_on_a_time_blames_the_timestamp():
    assert "date or time" in divergence_cause("Today is 2026-11-", "26, be brief", "25, be brief")
    assert "date or time" in divergence_cause("It is 14:0", "4 now", "3 now")


def test_other_divergences_have_no_guess():
    assert divergence_cause("<tool_call>\n{}\n</tool_call>\nThe answer is ", "blue", "red") is None
    assert divergence_cause("prompt number ", "2", "1") is None


@pytest.mark.slow
def test_the_prefix_report_names_changed_tool_definitions(embedded):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.engine.sample.sampling import SamplingParams
    from kvserve.tools.rendering import Turn, render_conversation
    from tests.helpers import run_to_finals

    engine = Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=embedded)
    tokenizer = engine.tokenizer
    weather = FunctionTool("get_weather", "The weather in a city", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}})
    # the client re-serialized the schema with its keys sorted
    resorted = FunctionTool("get_weather", "The weather in a city", {"properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}, "type": "object"})
    turns = [Turn("system", "You are a weather assistant."), Turn("user", "Weather in Paris?")]
    reports = []
    for tools in ([weather], [resorted]):
        messages, variables = render_conversation(turns, tools, tokenizer.chat_template)
        request_id = engine.add_request(tokenizer.encode_chat(messages, **variables),
                                        SamplingParams(max_tokens=1, temperature=0.0))
        reports.append(run_to_finals(engine)[request_id].prefix_cache)
    assert "likely cause: the tool definitions changed" in reports[1].reason
