"""The one prompt builder: marks found in tokens, templates that render tools themselves keep turn N cached in
turn N + 1, one rule for history arguments, template errors as 400s naming the field."""

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.prompt.answers import GeneratedAnswers
from kvserve.server.prompt.builder import Conversation, PromptBuilder
from kvserve.tools.calls import FunctionTool, ToolCall, calls_text
from kvserve.tools.rendering import Turn
from tests.server.inprocess import tiny_tokenizer

WEATHER = FunctionTool("get_weather", "The weather in a city.",
                       {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = ToolCall("call_7", "get_weather", '{"city": "Paris"}')

# Qwen3's layout: tools in the system message, calls as <tool_call> JSON after the content (as its template
# writes them, `arguments` through tojson), results in user turns as <tool_response>.
QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.function.arguments is string %}{{- tool_call.function.arguments }}"
    "{%- else %}{{- tool_call.function.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# Llama 3.1's layout: a call is the assistant turn's whole content, `{"name": ..., "parameters": ...}`.
LLAMA31_STYLE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{%- if tools and loop.first %}{{- 'Given the following functions, respond with a JSON function call.\\n\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.tool_calls %}{%- set call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call.name + '\", \"parameters\": ' }}"
    "{{- call.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content"
    " + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLAMA31_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def tokenizer_with(template: str | None = None):
    tokenizer = tiny_tokenizer()
    if template:
        tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("template, generated_text", [(QWEN3_STYLE, QWEN3_CALL), (LLAMA31_STYLE, LLAMA31_CALL),
                                                      (None, calls_text([CALL]))],
                         ids=["qwen3-style", "llama3.1-style", "default-block"])
def test_turn_n_plus_1_holds_all_of_turn_n_prompt_and_answer(template, generated_text):
    tokenizer = tokenizer_with(template)
    answers = GeneratedAnswers()
    builder = PromptBuilder(tokenizer, answers)
    turns = [Turn("system", "Be brief."), Turn("user", "Weather in Paris?")]
    first = builder.build(Conversation(turns, [WEATHER], tenant="t")).token_ids
    # the model's ids for its call: not how the tokenizer would split the text
    generated = tuple(reversed(tokenizer.encode(generated_text, add_special_tokens=False)))
    answers.remember("t", CALL.id, generated_text, generated)
    loop = turns + [Turn("assistant", "", [CALL]), Turn("tool", '{"temp": 21}', tool_call_id=CALL.id)]
    second = builder.build(Conversation(loop, [WEATHER], tenant="t")).token_ids
    assert second[:len(first) + len(generated)] == first + list(generated)
    # the rest is the template's own rendering of what follows the answer
    text = tokenizer.apply_chat_template(builder.messages(Conversation(loop, [WEATHER]))[0], True,
                                         **builder.messages(Conversation(loop, [WEATHER]))[1])
    assert text.startswith(tokenizer.decode(first, skip_special_tokens=False) + generated_text)


def test_an_answer_the_template_renders_otherwise_is_not_spliced():
    tokenizer = tokenizer_with(QWEN3_STYLE)
    answers = GeneratedAnswers()
    builder = PromptBuilder(tokenizer, answers)
    answers.remember("t", CALL.id, LLAMA31_CALL, (1, 2, 3))  # not what this template writes for the call
    loop = [Turn("user", "Weather?"), Turn("assistant", "", [CALL]), Turn("tool", "21", tool_call_id=CALL.id)]
    spliced = builder.build(Conversation(loop, [WEATHER], tenant="t")).token_ids
    assert spliced == builder.build(Conversation(loop, [WEATHER])).token_ids


def test_marks_are_the_tokens_before_them():
    tokenizer = tokenizer_with()
    builder = PromptBuilder(tokenizer)
    system = Turn("system", "Cache this. And not this.", marks=[(len("Cache this."), "a")])
    user = Turn("user", "The capital?", marks=[(len("The capital?"), "b")])
    prompt = builder.build(Conversation([system, user], [WEATHER], tools_mark="tools"))
    text = tokenizer.apply_chat_template(builder.messages(Conversation([system, user], [WEATHER]))[0], True)
    assert prompt.token_ids == tokenizer.encode(text, add_special_tokens=False)
    found = dict((tag, n) for n, tag in prompt.marks)
    assert [tag for _, tag in prompt.marks] == ["a", "tools", "b"]  # in prompt order
    up_to_user_end = tokenizer.encode(text[:text.index("The capital?") + len("The capital?")], add_special_tokens=False)
    assert found["b"] == len(up_to_user_end)
    assert 0 < found["a"] < found["tools"] < found["b"]
    for n, _ in prompt.marks:  # every mark lies on the prompt's own tokens
        assert tokenizer.decode(prompt.token_ids[:n], skip_special_tokens=False) in text


def test_reserved_sequences_are_refused_where_marks_are_read():
    builder = PromptBuilder(tokenizer_with())
    sneaky = Turn("user", "hi \x00kvserve-mark-0\x00", marks=[(2, "x")])
    with pytest.raises(InvalidRequestError, match="reserved") as error:
        builder.build(Conversation([sneaky], param="messages"))
    assert error.value.param == "messages"


@pytest.mark.parametrize("template", [QWEN3_STYLE, None], ids=["template-tools", "default-block"])
def test_history_arguments_that_are_not_json_are_rendered_as_sent(template):
    builder = PromptBuilder(tokenizer_with(template))
    call = ToolCall("call_1", "get_weather", "{not json")
    turns = [Turn("user", "hi"), Turn("assistant", "", [call]), Turn("tool", "1", tool_call_id="call_1")]
    text = builder.tokenizer.decode(builder.build(Conversation(turns, [WEATHER])).token_ids, skip_special_tokens=False)
    assert '"arguments": {not json}' in text


def test_a_template_error_is_a_400_naming_the_field():
    strict = "{{ raise_exception('roles must alternate') }}"
    builder = PromptBuilder(tokenizer_with(strict))
    with pytest.raises(InvalidRequestError, match="refused these messages: roles must alternate") as error:
        builder.build(Conversation([Turn("user", "hi")], param="input"))
    assert error.value.param == "input"


def test_a_prompt_that_cannot_fit_is_refused_before_rendering():
    builder = PromptBuilder(tokenizer_with(), max_prompt_chars=10, context_tokens=5)
    with pytest.raises(InvalidRequestError, match="more than any prompt that fits") as error:
        builder.build(Conversation([Turn("user", "x" * 11)]))
    assert error.value.param == "messages"
    with pytest.raises(InvalidRequestError):
        builder.encode_text("y" * 11)
