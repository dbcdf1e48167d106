"""Tools and structured output through the real clients (openai, anthropic) and two agent frameworks
(openai-agents, langchain-openai) against a real server on the embedded model. A 135M model does not
pick tools wisely, so where an assertion needs a call, tool_choice forces it (required / named) and the
grammar makes it valid; elsewhere the tests check shapes."""

import asyncio
import json

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                          "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    # Bounded: a 135M model writes digits until max_tokens when nothing stops it, valid all along
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=99_999_999)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def _call_weather(client, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=QUESTION, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0, **kwargs)


def test_a_named_tool_choice_gives_a_valid_call(client):
    response = _call_weather(client)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_streamed_tool_calls_assemble_to_the_same_call(client):
    full = _call_weather(client).choices[0].message.tool_calls[0]
    model = client.models.list().data[0].id
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=[WEATHER, CLOCK], max_tokens=40,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    kinds = [event.type for event in events]
    assert "tool_calls.function.arguments.delta" in kinds
    for chunk in [event.chunk for event in events if event.type == "chunk"]:
        indexes = [call.index for call in chunk.choices[0].delta.tool_calls or []] if chunk.choices else []
        assert len(indexes) == len(set(indexes)), chunk  # one entry per call in a chunk, as OpenAI sends them
    streamed = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, streamed.function.arguments) == (full.function.name, full.function.arguments)


def test_required_with_parallel_calls_off_is_exactly_one_call(client):
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert response.choices[0].finish_reason == "tool_calls"
    assert len(response.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("streamed", [False, True])
def test_turn_two_of_a_tool_loop_hits_the_whole_of_turn_one(client, streamed):
    """The model's own tokens for its call come back (SmolLM2 writes `"}` + `}` where the tokenizer
    splits `"` + `}}`: re-tokenized, turn two would miss from there)."""
    question = QUESTION[:1] + [{"role": "user", "content": f"Is it raining in {'Oslo' if streamed else 'Bern'}?"}]
    kwargs = dict(model=client.models.list().data[0].id, tools=[WEATHER, CLOCK], temperature=0, max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if streamed:
        with client.chat.completions.stream(messages=question, stream_options={"include_usage": True},
                                            **kwargs) as stream:
            first = stream.get_final_completion()
    else:
        first = client.chat.completions.create(messages=question, **kwargs)
    call = first.choices[0].message.tool_calls[0]
    history = question + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = client.chat.completions.create(messages=history, **{**kwargs, "tool_choice": "auto", "max_tokens": 8})
    turn_one = first.usage.prompt_tokens + first.usage.completion_tokens
    block = 16
    assert second.usage.prompt_tokens > turn_one
    assert second.usage.prompt_tokens_details.cached_tokens >= turn_one // block * block


def test_turn_two_of_an_anthropic_tool_loop_hits_the_whole_of_turn_one(server):
    """tool_use blocks sent back as they came: the model's own ids for its call are spliced back, as in chat."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}]
    question = [{"role": "user", "content": "Is it snowing in Riga?"}]
    kwargs = dict(model="SmolLM2-135M-Instruct", system="You are a weather assistant.", tools=tools,
                  extra_body={"temperature": 0})
    first = client.messages.create(**kwargs, max_tokens=40, messages=question,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    second = client.messages.create(**kwargs, max_tokens=8, messages=[
        *question, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Snow, -3 C"}]}])
    turn_one = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= turn_one // 16 * 16


def test_turn_two_of_a_stateless_responses_tool_loop_hits_the_whole_of_turn_one(client):
    """The items resent (openai-agents' default, no previous_response_id): the call's generated ids come back."""
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER_SCHEMA}]
    question = [{"role": "user", "content": "Is it windy in Lima?"}]
    kwargs = dict(model=client.models.list().data[0].id, instructions="You are a weather assistant.", tools=tools,
                  temperature=0, store=False)
    first = client.responses.create(**kwargs, input=question, max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    items = [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls]
    second = client.responses.create(**kwargs, max_output_tokens=8, input=[
        *question, *items, {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Calm"}])
    turn_one = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= turn_one // 16 * 16


def test_chat_completions_parse_gives_the_model(client):
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id, response_format=City, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON with its name and population."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)


def test_completions_follow_a_regex_and_a_choice(client):
    model = client.models.list().data[0].id
    text = client.completions.create(model=model, prompt="The answer is", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0].text
    assert text in ("yes", "no")
    text = client.completions.create(model=model, prompt="A year:", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}}).choices[0].text
    assert len(text) == 4 and text.isdigit()


def test_responses_function_call_then_its_output_through_previous_response_id(client):
    model = client.models.list().data[0].id
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER_SCHEMA, "strict": True}]
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=tools,
                                    tool_choice="required", max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(model=model, previous_response_id=first.id, tools=tools, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny"}], temperature=0)
    turn_one = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= turn_one // 16 * 16
    with client.responses.stream(model=model, input="Weather in Rome?", tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=40, temperature=0) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
    assert [item.type for item in final.output] == ["function_call"]
    parsed = client.responses.parse(model=model, input="Describe Paris: name and population.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City)


def test_anthropic_tool_use_whole_and_streamed(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    # (a description of its own: the Responses test cached the same manifest otherwise)
    tools = [{"name": "get_weather", "description": "Today's weather in a city", "input_schema": WEATHER_SCHEMA,
              "cache_control": {"type": "ephemeral"}}]
    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=40, tools=tools, extra_body={"temperature": 0},
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"} and use.id.startswith("toolu_")
    assert message.usage.cache_creation_input_tokens > 0  # the tools' breakpoint
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input
    follow = client.messages.create(**{**kwargs, "tool_choice": {"type": "auto"}, "max_tokens": 8, "messages": [
        *kwargs["messages"], {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]})
    assert follow.usage.cache_read_input_tokens > 0


def test_openai_agents_runs_a_function_tool(server):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    agents.set_tracing_disabled(True)

    async def run_both() -> list:
        client = openai.AsyncOpenAI(base_url=server.api_url, api_key="unused")
        outputs = []
        for model in (agents.OpenAIChatCompletionsModel(model="SmolLM2-135M-Instruct", openai_client=client),
                      agents.OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=client)):
            agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                                 tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                                 model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                                                     max_tokens=40))
            result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
            outputs.append(result.final_output)
        return outputs

    outputs = asyncio.run(run_both())
    assert len(calls) == 2 and outputs == [f"Sunny in {city}" for city in calls]


def test_langchain_bind_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny"

    llm = langchain_openai.ChatOpenAI(model="SmolLM2-135M-Instruct", base_url=server.api_url, api_key="unused",
                                      temperature=0, max_tokens=60, max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert set(message.tool_calls[0]["args"]) == {"city"}
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris: name and population.")
        assert isinstance(city, City)


def test_tool_choice_none_keeps_the_prompt_and_never_opens_a_call(client):
    """After a few turns that each made a call, the model calls again under "auto"; under "none" it used to
    write the call as text (`<tool_call>`, then near misses like `<tool_call]` once that was banned)."""
    history = []
    for i, city in enumerate(["Oslo", "Rome", "Bern", "Kyiv"]):
        history += [{"role": "user", "content": f"Weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": f"call_{i}", "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}]
    kwargs = dict(model=client.models.list().data[0].id, tools=[WEATHER], max_tokens=30, temperature=0,
                  messages=[*history, {"role": "user", "content": "Weather in Paris?"}])
    auto = client.chat.completions.create(tool_choice="auto", **kwargs)
    none = client.chat.completions.create(tool_choice="none", **kwargs)
    assert auto.choices[0].message.tool_calls  # here the model calls, so "none" has a call to refuse
    assert "<tool_call" not in none.choices[0].message.content and not none.choices[0].message.tool_calls
    # the same prompt (the tools stay in it): the second request reads the first's cache
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    assert none.usage.prompt_tokens_details.cached_tokens >= auto.usage.prompt_tokens // 16 * 16
