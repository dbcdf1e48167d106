"""The miss explainer's causes for agent loops."""

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
