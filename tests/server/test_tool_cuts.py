"""A forced tool call cut by max_tokens at every point, through each API's official client against a real
server on the embedded model: reported as a cut call in the API's own terms, never as text, never with
the call layout's markup in its arguments or content."""

import anthropic
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": SCHEMA}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "SmolLM2-135M-Instruct"
MARKUP = ("<tool", "</tool", "tool_call>", '"name"')


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def whole(client):
    """The uncut call, and how many tokens it takes."""
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TOOL], tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert response.choices[0].finish_reason == "tool_calls"
    return response.choices[0].message.tool_calls[0].function.arguments, response.usage.completion_tokens


def test_chat_a_required_call_cut_at_every_token_is_a_partial_call(client, whole):
    arguments, num_tokens = whole
    for max_tokens in range(1, num_tokens + 3):
        response = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
            max_tokens=max_tokens, temperature=0)
        choice = response.choices[0]
        assert not choice.message.content, (max_tokens, choice.message.content)
        calls = choice.message.tool_calls or []
        for call in calls:
            assert call.function.name == "get_weather"
            assert arguments.startswith(call.function.arguments), (max_tokens, call.function.arguments)
        if max_tokens < num_tokens:
            assert choice.finish_reason == "length", max_tokens
        else:
            assert choice.finish_reason == "tool_calls" and calls[0].function.arguments == arguments


def test_chat_streamed_cut_calls_assemble_to_the_same_partial_call(client, whole):
    arguments, num_tokens = whole
    for max_tokens in range(2, num_tokens, 6):
        kwargs = dict(model=MODEL, messages=QUESTION, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                      max_tokens=max_tokens, temperature=0)
        full = client.chat.completions.create(**kwargs).choices[0]
        with client.chat.completions.stream(**kwargs) as stream:
            for _ in stream:  # (get_final_completion refuses a "length" finish)
                pass
            streamed = stream.current_completion_snapshot.choices[0]
        assert streamed.finish_reason == "length" and not streamed.message.content
        assert [c.function.arguments for c in streamed.message.tool_calls or []] == \
            [c.function.arguments for c in full.message.tool_calls or []]


def test_anthropic_a_cut_tool_use_keeps_its_block_and_an_object_input(server, whole):
    arguments, num_tokens = whole
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
    for max_tokens in range(1, num_tokens, 6):
        kwargs = dict(model=MODEL, max_tokens=max_tokens, tools=[tool], tool_choice={"type": "any"},
                      messages=QUESTION, extra_body={"temperature": 0})
        message = client.messages.create(**kwargs)
        assert message.stop_reason == "max_tokens", max_tokens
        assert [block.type for block in message.content] in ([], ["tool_use"]), message.content
        for block in message.content:
            assert block.name == "get_weather" and isinstance(block.input, dict)
            assert "_partial_json" not in block.input
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == \
            [b.type for b in message.content]


def test_responses_a_cut_function_call_is_an_incomplete_item(client, whole):
    arguments, num_tokens = whole
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}]
    for max_tokens in (num_tokens - 8, num_tokens - 3):  # in the arguments, in the suffix
        kwargs = dict(model=MODEL, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                      parallel_tool_calls=False, max_output_tokens=max_tokens, temperature=0)
        response = client.responses.create(**kwargs)
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        (item,) = response.output
        assert item.type == "function_call" and item.status == "incomplete"
        assert arguments.startswith(item.arguments) and not any(m in item.arguments for m in MARKUP)
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
        done = [event.item for event in events if event.type == "response.output_item.done"]
        (final,) = [event.response for event in events if event.type == "response.incomplete"]
        assert [i.status for i in done] == ["incomplete"] and final.output[0].arguments == item.arguments


def test_parsed_tool_calls_are_counted_on_metrics(server, client, whole):
    before = server.metric("kvserve:tool_calls_parsed_total")  # (the uncut call made one already)
    client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TOOL], tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert server.metric("kvserve:tool_calls_parsed_total") == before + 1
    assert server.metric("kvserve:constrained_requests_total") >= 2
