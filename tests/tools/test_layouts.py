"""Call layouts per chat template: the grammar forces the layout the template writes history calls in, the
parser reads it back, and the template's rendering of the call in the next prompt is the generated text
byte for byte (Qwen3's and Llama 3.1's own templates, copied as test fixtures)."""

from pathlib import Path

import pytest

from kvserve.model.tokenizer import Tokenizer
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import GrammarMatcher, GrammarStateError
from kvserve.structured.vocabulary import build_grammar_vocabulary
from kvserve.tools.calls import FunctionTool, ToolCall, calls_text
from kvserve.tools.grammar import ToolChoice, tool_call_constraint
from kvserve.errors import InvalidRequestError
from kvserve.tools.layouts import (HARMONY, HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, PHI4, detect_layout,
                                   layout_for_template)
from kvserve.tools.parsing import parse_output
from tests.helpers import TINY_VOCAB
from tests.server.inprocess import CHATML, tiny_tokenizer

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
LLAMA31 = (TEMPLATES / "llama3_1.jinja").read_text()
MINISTRAL3 = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()
PHI4_MINI = (TEMPLATES / "llama-cpp-microsoft-Phi-4-mini-instruct.jinja").read_text()
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
SMOLLM3 = (TEMPLATES / "HuggingFaceTB-SmolLM3-3B.jinja").read_text()
MISTRAL_TEMPLATE = ("{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
                    "{{ c.function | tojson }}{% endfor %}]{% endif %}{% endfor %}")
WEATHER = FunctionTool("get_weather", None, {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]})
CLOCK = FunctionTool("get_time")
CALLS = [ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 3}'), ToolCall("call_2", "get_time", "{}")]
PARALLEL = {HERMES.name: 2, LLAMA3_JSON.name: 1, MISTRAL.name: 2, MISTRAL_ARGS.name: 2, PHI4.name: 2, HARMONY.name: 1}
ALL = [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, PHI4, HARMONY]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_grammar_vocabulary(tiny_tokenizer(), TINY_VOCAB))


def test_the_layout_is_recognised_from_the_template():
    assert layout_for_template(QWEN3) is HERMES
    assert layout_for_template(LLAMA31) is LLAMA3_JSON
    assert layout_for_template(MISTRAL_TEMPLATE) is MISTRAL
    assert layout_for_template(CHATML) is HERMES and layout_for_template(None) is HERMES  # kvserve's own block
    assert layout_for_template(MINISTRAL3) is MISTRAL_ARGS
    assert layout_for_template(PHI4_MINI) is PHI4
    assert layout_for_template(GPT_OSS) is HARMONY
    assert layout_for_template(SMOLLM3) is HERMES  # it does not render tools: kvserve's block, SmolLM3's own layout


def test_a_template_that_renders_tools_in_an_unknown_layout_refuses_tools_only():
    from kvserve.server.core.tool_use import ToolUse

    unknown = "{% for t in tools %}<fn>{{ t | tojson }}</fn>{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_layout(unknown).name == "unknown"
    with pytest.raises(InvalidRequestError, match="call layout kvserve does not know") as error:
        ToolUse([WEATHER], ToolChoice("auto")).with_template(unknown)
    assert error.value.param == "tools"
    assert ToolUse().with_template(unknown).layout is HERMES  # no tools: served as usual


def test_hermes_is_the_default_layout_byte_for_byte():
    assert CALLS[0].text() == CALLS[0].text(HERMES) == \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.mark.parametrize("layout", ALL, ids=lambda layout: layout.name)
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_call_in_the_layout_is_what_the_grammar_allows_and_parses_back(compiler, layout, mode):
    calls = CALLS[:PARALLEL[layout.name]]
    text = calls_text(calls, layout)
    spec = tool_call_constraint([WEATHER, CLOCK], ToolChoice(mode), layout=layout)
    matcher = GrammarMatcher(compiler.compile(spec), compiler.vocabulary, spec.trigger)
    prefix = "Let me check. " if mode == "auto" else ""
    matcher.consume(tiny_tokenizer().encode(prefix + text, add_special_tokens=False))
    assert matcher.is_accepting  # the whole call (or calls): the output may end here
    parsed = parse_output(prefix + text, layout=layout, calls_only=mode == "required")
    assert parsed.content == prefix and [(c.name, c.arguments) for c in parsed.calls] == \
        [(c.name, c.arguments) for c in calls]


def test_another_layout_is_refused_by_the_grammar(compiler):
    spec = tool_call_constraint([WEATHER, CLOCK], ToolChoice("required"), layout=LLAMA3_JSON)
    matcher = GrammarMatcher(compiler.compile(spec), compiler.vocabulary)
    with pytest.raises(GrammarStateError, match="fails parse"):
        matcher.consume(tiny_tokenizer().encode(calls_text(CALLS[:1], HERMES), add_special_tokens=False))


@pytest.mark.parametrize("template, layout, before, after", [
    (QWEN3, HERMES, "<|im_start|>assistant\n", "<|im_end|>"),
    (LLAMA31, LLAMA3_JSON, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    (MINISTRAL3, MISTRAL_ARGS, "[/INST]", "</s>"),
    (PHI4_MINI, PHI4, "<|assistant|>", "<|end|>"),
], ids=["qwen3", "llama3.1", "ministral3", "phi4-mini"])
def test_the_template_renders_a_generated_call_back_as_generated(template, layout, before, after):
    """The next turn's prompt holds exactly the text the model generated for its call (the template gets the
    arguments as an object, as Hugging Face templates expect, and writes them with its own tojson)."""
    tokenizer = Tokenizer(tiny_tokenizer().backend, bos_token="<s>", eos_token="</s>", chat_template=template)
    calls = CALLS[:PARALLEL[layout.name]]
    generated = calls_text(calls, layout)
    messages = [{"role": "user", "content": "Weather in Paris for 3 days, and the time?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_object()}}
                    for c in calls]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    tools = [tool.openai() for tool in (WEATHER, CLOCK)]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert before + generated + after in prompt


def test_tool_use_carries_its_template_s_layout_to_the_grammar_and_the_parser():
    from kvserve.server.core.tool_use import ToolUse

    default = ToolUse([WEATHER], ToolChoice("required"))
    assert default.layout is HERMES and default.constraint().grammar.startswith('start: call ("\\n" call)*')
    llama = ToolUse([WEATHER], ToolChoice("required")).with_template(LLAMA31)
    assert llama.layout is LLAMA3_JSON and 'parameters' in llama.constraint().grammar
    text = calls_text(CALLS[:1], LLAMA3_JSON)
    assert [(c.name, c.arguments) for c in llama.parser().parse(text).calls] == [(CALLS[0].name, CALLS[0].arguments)]


def test_gpt_oss_s_template_renders_a_call_otherwise_than_the_model_writes_it():
    """Harmony: the model writes `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`, its template
    renders a history call `to=functions.NAME<|channel|>commentary json<|message|>`: no splice can hold there."""
    tokenizer = Tokenizer(tiny_tokenizer().backend, bos_token="<s>", eos_token="</s>", chat_template=GPT_OSS)
    call = CALLS[0]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_object()}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    described = FunctionTool(WEATHER.name, "The weather", WEATHER.parameters)  # (its template needs one)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=[described.openai()])
    assert call.text(HARMONY) not in prompt
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>' in prompt
