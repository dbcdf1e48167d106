"""Each family's published chat template (tests/fixtures/templates) behind the server, with the official clients:
its reasoning apart from the answer, its calls forced and read in its own layout, and a tool loop's turn two
beginning with turn one's prompt and generated tokens where the template renders the answer back as generated.

The embedded model's tokenizer and config, its output scripted (tests/server/scripted.py): the tags and layouts
are text the 135M model never writes. The grammar's mask still applies to the script."""

from pathlib import Path

import anthropic
import ollama
import openai
import pytest

from tests.server.inprocess import serve_in_process
from tests.server.scripted import scripted

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
QUESTION = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]
OSLO = '{"city": "Oslo"}'

# family -> (template file, a scripted answer that thinks and calls, its thinking, whether the template renders
# the answer back as generated: turn two then begins with turn one's prompt and output)
FAMILIES = {
    "qwen3": ("qwen3.jinja", '<think>\nOslo is a city.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
              f'"arguments": {OSLO}}}\n</tool_call>', "Oslo is a city.", True),
    "llama3.1": ("llama3_1.jinja", f'{{"name": "get_weather", "parameters": {OSLO}}}', None, True),
    "ministral3": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja",
                   f"[THINK]Oslo is a city.[/THINK][TOOL_CALLS]get_weather[ARGS]{OSLO}", "Oslo is a city.", False),
    "phi4-mini": ("llama-cpp-microsoft-Phi-4-mini-instruct.jinja",
                  f'<|tool_call|>{{"name": "get_weather", "arguments": {OSLO}}}<|/tool_call|>', None, True),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", '<think>\nOslo is a city.\n</think>\n<tool_call>\n'
                f'{{"name": "get_weather", "arguments": {OSLO}}}\n</tool_call>', "Oslo is a city.", False),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", "<|channel|>analysis<|message|>Oslo is a city.<|end|><|start|>assistant"
                f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{OSLO}<|call|>",
                "Oslo is a city.", False),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, embedded):
    name = request.param
    template, script, thinking, renders_back = FAMILIES[name]
    loaded, model = scripted(embedded, (TEMPLATES / template).read_text())
    with serve_in_process(loaded, kv_cache_memory="64MiB") as app:
        yield name, app, model, script, thinking, renders_back


def _client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=app, max_retries=0)


def test_thinking_and_a_forced_call_in_the_family_s_layout(family):
    name, app, model, script, thinking, _ = family
    model.say(script)
    reply = _client(app).chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER],
                                                  tool_choice="required", max_tokens=80)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", OSLO)]
    assert getattr(message, "reasoning_content", None) == thinking and not message.content
    details = reply.usage.completion_tokens_details
    assert (details.reasoning_tokens > 0) if thinking else (details is None or not details.reasoning_tokens)


def test_streamed_the_thinking_and_the_call_assemble_to_the_same(family):
    name, app, model, script, thinking, _ = family
    model.say(script)
    chunks = list(_client(app).chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER],
                                                        tool_choice="required", max_tokens=80, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    streamed_thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed_thinking == (thinking or "")
    arguments = "".join(c.function.arguments or "" for d in deltas for c in d.tool_calls or [])
    assert arguments == OSLO and not "".join(d.content or "" for d in deltas)


def test_turn_two_of_a_tool_loop_begins_with_turn_one(family):
    """Where the template renders the answer back as generated (the thinking sent back as reasoning_content),
    turn two's prompt tokens begin with turn one's prompt and every generated token; elsewhere (the template
    drops or moves the thinking, or writes the call otherwise) it does not, and the test says which."""
    name, app, model, script, thinking, renders_back = family
    client = _client(app)
    body = {"model": "tiny", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80}
    turn_one = app.post("/tokenize", json=body).json()["tokens"]
    model.say(script)
    reply = client.chat.completions.create(**body)
    generated = model.generated_ids  # (all but the last, EOS, which no prompt needs to hold)
    call = reply.choices[0].message.tool_calls[0]
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    if thinking:
        assistant["reasoning_content"] = thinking
    history = QUESTION + [assistant, {"role": "tool", "tool_call_id": call.id, "content": "Snow"}]
    turn_two = app.post("/tokenize", json={**body, "messages": history, "tool_choice": "auto"}).json()["tokens"]
    holds = turn_two[:len(turn_one) + len(generated)] == turn_one + generated
    assert holds is renders_back, name


def _anthropic(app) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=app, max_retries=0)


ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city",
                  "input_schema": WEATHER["function"]["parameters"]}


def test_anthropic_thinking_blocks_then_the_tool_use_whole_and_streamed(family):
    name, app, model, script, thinking, _ = family
    kwargs = dict(model="tiny", max_tokens=80, system="You help.", tools=[ANTHROPIC_TOOL],
                  messages=[{"role": "user", "content": "Weather in Oslo?"}], tool_choice={"type": "any"},
                  **({"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}))
    model.say(script)
    whole = _anthropic(app).messages.create(**kwargs)
    model.say(script)
    with _anthropic(app).messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        assert [block.type for block in message.content] == (["thinking"] if thinking else []) + ["tool_use"]
        assert message.content[-1].input == {"city": "Oslo"}
        if thinking:
            assert message.content[0].thinking == thinking
    assert ("thinking" in kinds) is bool(thinking)  # the SDK's event for each thinking_delta


def test_responses_reasoning_item_then_the_function_call_whole_and_streamed(family):
    name, app, model, script, thinking, _ = family
    kwargs = dict(model="tiny", input="Weather in Oslo?", instructions="You help.", max_output_tokens=80,
                  tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required",
                  **({"reasoning": {"effort": "high"}} if thinking else {}))
    model.say(script)
    whole = _client(app).responses.create(**kwargs)
    model.say(script)
    with _client(app).responses.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == (["reasoning"] if thinking else []) + ["function_call"]
        assert (response.output[-1].name, response.output[-1].arguments) == ("get_weather", OSLO)
        if thinking:
            assert response.output[0].content[0].text == thinking
        assert (response.usage.output_tokens_details.reasoning_tokens > 0) is bool(thinking)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == (thinking or "")


def test_ollama_think_puts_the_thinking_apart_and_the_call_whole(family):
    """No tool_choice in Ollama's API: "auto", the call opened by the model after its thinking."""
    name, app, model, script, thinking, _ = family
    client = ollama.Client(host="http://testserver")
    client._client = app
    model.say(script)
    reply = client.chat(model="tiny", messages=QUESTION, tools=[WEATHER], options={"num_predict": 80},
                        **({"think": True} if thinking else {}))
    assert reply.message.thinking == thinking and not reply.message.content
    assert [(c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
