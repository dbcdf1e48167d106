"""A request's reasoning switch per API on each family's template: template variables, refusals, where a
constraint starts."""

from pathlib import Path

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.reasoning import HARMONY, THINK_TAGS

TEMPLATES = Path(__file__).parent.parent.parent / "fixtures" / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
LLAMA31 = (TEMPLATES / "llama3_1.jinja").read_text()


def test_each_switch_becomes_the_template_s_variables():
    assert ReasoningUse.of(QWEN3).variables() == {}  # the template's default
    assert ReasoningUse.of(QWEN3, False).variables() == {"enable_thinking": False}
    assert ReasoningUse.of(QWEN3, None, "none").variables() == {"enable_thinking": False}
    assert ReasoningUse.of(QWEN3, None, "high").variables() == {"enable_thinking": True}
    kwargs = ReasoningUse.of(QWEN3, template_kwargs={"enable_thinking": False, "custom": 1})
    assert kwargs.enabled is False and kwargs.variables() == {"enable_thinking": False, "custom": 1}
    assert ReasoningUse.of(GPT_OSS, None, "high").variables() == {"reasoning_effort": "high"}
    assert ReasoningUse.of(GPT_OSS).format is HARMONY and ReasoningUse.of(QWEN3).format is THINK_TAGS


def test_bad_switches_are_refused_by_name():
    with pytest.raises(InvalidRequestError) as error:
        ReasoningUse.of(LLAMA31, True, param="thinking")
    assert error.value.param == "thinking" and "does not reason" in str(error.value)
    assert ReasoningUse.of(LLAMA31, False).variables() == {}  # off on a model that never thinks: nothing to do
    with pytest.raises(InvalidRequestError) as error:
        ReasoningUse.of(QWEN3, template_kwargs={"messages": []})
    assert error.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="effort"):
        ReasoningUse.of(GPT_OSS, None, "extreme", param="reasoning")


def test_a_constraint_starts_after_the_thinking_unless_the_prompt_closed_it():
    spec = StructuredOutputsParams(grammar='start: "<tool_call>"')
    gated = ReasoningUse.of(QWEN3).gate(spec)
    assert gated.after == "</think>" and gated.grammar.startswith("start: gated_start | GATED_SPACE gated_start")
    closed = ReasoningUse(THINK_TAGS, False, closed=True)
    assert closed.gate(spec) is spec
    schema = ReasoningUse.of(QWEN3).gate(StructuredOutputsParams(json={"type": "object"}))
    assert schema.after == "</think>" and "%json" in schema.grammar
    assert ReasoningUse.of(LLAMA31).gate(spec) is spec  # no reasoning, nothing to gate
