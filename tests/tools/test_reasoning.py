"""Thinking split from the answer, whole and at every cut of a stream."""

import pytest

from pathlib import Path

from kvserve.tools.layouts import HARMONY as HARMONY_CALLS
from kvserve.tools.parsing import parse_output
from kvserve.tools.reasoning import (HARMONY, MISTRAL_THINK, THINK_TAGS, ThinkingSplitter, reasoning_for_template,
                                     split_thinking, template_supports_thinking)

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"

CASES = [
    ("<think>\nPlan it.\n</think>\n\nThe answer.", False, ("Plan it.", "The answer.")),
    ("Plan it.\n</think>\n\nThe answer.", True, ("Plan it.", "The answer.")),  # the template opened it
    ("<think>\nStill thinking\n", False, ("Still thinking", "")),  # cut short
    ("<think>\n\n</think>\n\nNo thoughts.", False, ("", "No thoughts.")),
    ("\nNever thought.", False, ("", "\nNever thought.")),  # no tag: the answer as written
    ("<thi", False, ("", "<thi")),
]


@pytest.mark.parametrize("text, opened, expected", CASES)
def test_whole_and_streamed_in_every_cut_agree(text, opened, expected):
    assert split_thinking(text, opened) == expected
    for cut in range(len(text) + 1):
        splitter = ThinkingSplitter(opened)
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected, cut


def test_a_template_that_knows_thinking():
    assert template_supports_thinking("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}")
    assert not template_supports_thinking("<|im_start|>{{ m.content }}")
    assert not template_supports_thinking(None)


HARMONY_CASES = [
    ("<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>final<|message|>The answer.",
     ("Plan it.", "The answer.")),
    ("<|channel|>analysis<|message|>Check <tool_call> here.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
     ("Check <tool_call> here.",
      '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')),
    ("<|channel|>analysis<|message|>Cut sho", ("Cut sho", "")),
    ("Plain text, no channel.", ("", "Plain text, no channel.")),
    ("<|channel|>commentary<|message|>Looking it up.<|end|>", ("", "Looking it up.")),  # a preamble is answer
]


@pytest.mark.parametrize("text, expected", HARMONY_CASES)
def test_harmony_channels_whole_and_streamed_in_every_cut_agree(text, expected):
    assert split_thinking(text, reasoning=HARMONY) == expected
    for cut in range(len(text) + 1):
        parser = HARMONY.parser()
        parts = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected, cut


def test_a_call_in_harmony_s_commentary_channel_is_read_a_call_in_the_analysis_is_not():
    thinking, answer = split_thinking(HARMONY_CASES[1][0], reasoning=HARMONY)
    parsed = parse_output(answer, layout=HARMONY_CALLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Oslo"}')]
    assert parsed.content == "" and "<tool_call>" in thinking


@pytest.mark.parametrize("text, expected", [
    ("[THINK]Plan it.[/THINK]The answer.", ("Plan it.", "The answer.")),
    ("[THINK]Still", ("Still", "")),
    ("No thinking.", ("", "No thinking.")),
])
def test_mistral_think_tags(text, expected):
    assert split_thinking(text, reasoning=MISTRAL_THINK) == expected
    for cut in range(len(text) + 1):
        parser = MISTRAL_THINK.parser()
        parts = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected, cut


@pytest.mark.parametrize("template, reasoning", [
    ("qwen3.jinja", THINK_TAGS), ("HuggingFaceTB-SmolLM3-3B.jinja", THINK_TAGS),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", MISTRAL_THINK), ("openai-gpt-oss-120b.jinja", HARMONY),
    ("llama3_1.jinja", None), ("llama-cpp-microsoft-Phi-4-mini-instruct.jinja", None)])
def test_each_family_s_template_names_its_reasoning_format(template, reasoning):
    assert reasoning_for_template((TEMPLATES / template).read_text()) is reasoning


def test_each_format_s_switch_as_template_variables():
    assert THINK_TAGS.variables(False) == {"enable_thinking": False} and THINK_TAGS.variables(None) == {}
    assert HARMONY.variables(None, "high") == {"reasoning_effort": "high"}
    assert HARMONY.variables(False) == {"reasoning_effort": "low"}  # harmony always thinks: the least of it
    assert MISTRAL_THINK.variables(False) == {}  # no switch in its template
