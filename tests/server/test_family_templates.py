"""Each family's published chat template (tests/fixtures/templates) behind the server, with the official clients:
its reasoning apart from the answer, its calls forced and read in its own layout, and a tool loop's turn two
beginning with turn one's prompt and generated tokens where the template renders the answer back as generated.

The embedded model's tokenizer and config, its output scripted (tests/server/scripted.py): the tags and layouts
are text the 135M model never writes. The grammar's mask still applies to the script."""

import contextlib
import dataclasses
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


@pytest.fixture(scope="module")
def served(embedded):
    """name -> (app, scripted model) of each family's template, started once when first asked for."""
    apps: dict = {}
    with contextlib.ExitStack() as stack:
        def serve(name: str):
            if name not in apps:
                loaded, model = scripted(embedded, (TEMPLATES / FAMILIES[name][0]).read_text())
                apps[name] = stack.enter_context(serve_in_process(loaded, kv_cache_memory="64MiB")), model
            return apps[name]

        yield serve


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, served):
    name = request.param
    template, script, thinking, renders_back = FAMILIES[name]
    app, model = served(name)
    return name, app, model, script, thinking, renders_back


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


def _prompt(app, embedded, **body) -> str:
    """The text of the prompt a chat request would be computed on (/tokenize)."""
    tokens = app.post("/tokenize", json={"model": "tiny", "messages": QUESTION, **body}).json()["tokens"]
    return embedded.tokenizer.decode(tokens, skip_special_tokens=False)


@pytest.mark.parametrize("switch", [
    {"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}])
def test_qwen3_thinking_switched_off_closes_it_in_the_prompt_and_the_answer_is_all_content(served, embedded,
                                                                                            switch):
    app, model = served("qwen3")
    model.say("Snow, probably.")
    reply = _client(app).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=20, extra_body=switch)
    message = reply.choices[0].message
    assert message.content == "Snow, probably." and message.reasoning_content is None
    assert _prompt(app, embedded, **switch).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _prompt(app, embedded).endswith("<|im_start|>assistant\n")  # on by default: the model opens it


def test_smollm3_no_think_in_the_system_message_or_the_switch(served, embedded):
    app, model = served("smollm3")
    for messages, switch in [([{"role": "system", "content": "You help. /no_think"}, QUESTION[1]], {}),
                             (QUESTION, {"chat_template_kwargs": {"enable_thinking": False}})]:
        model.say("Snow.")
        reply = _client(app).chat.completions.create(model="tiny", messages=messages, max_tokens=8, extra_body=switch)
        prompt = _prompt(app, embedded, **{**switch, "messages": messages})
        assert reply.choices[0].message.content == "Snow." and "Reasoning Mode: /no_think" in prompt
        assert prompt.endswith("<think>\n\n</think>\n") and reply.choices[0].message.reasoning_content is None


@pytest.mark.parametrize("effort", ["low", "high"])
def test_gpt_oss_reasoning_effort_reaches_its_system_message(served, embedded, effort):
    app, model = served("gpt-oss")
    assert f"Reasoning: {effort}" in _prompt(app, embedded, reasoning_effort=effort)
    model.say("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Snow.")
    reply = _client(app).responses.create(model="tiny", input="Weather?", max_output_tokens=40,
                                          reasoning={"effort": effort})
    assert reply.output_text == "Snow." and reply.reasoning.effort == effort
    assert [item.type for item in reply.output] == ["reasoning", "message"]


def test_a_call_written_inside_the_thinking_is_not_a_call(served):
    """tool_choice auto: the call opener inside the thinking neither starts the grammar nor is parsed as a call."""
    app, model = served("qwen3")
    inner = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    model.say(f"<think>\nI could write {inner} here.\n</think>\n\nIt snows in Oslo.")
    reply = _client(app).chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], max_tokens=80)
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content == "It snows in Oslo."
    assert message.reasoning_content == f"I could write {inner} here."
    assert reply.choices[0].finish_reason == "stop"


def test_thinking_on_a_model_that_does_not_reason_is_refused_by_name(served):
    app, _ = served("llama3.1")
    refused = app.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user",
                       "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert refused.status_code == 400 and "thinking" in refused.text
    refused = app.post("/v1/responses", json={"model": "tiny", "input": "hi", "reasoning": {"effort": "high"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning"


def test_anthropic_turn_two_holds_turn_one_with_its_thinking_block_sent_back(served):
    """Qwen3 keeps the thinking of the turns after the last user message: a tool loop sends it back as the
    thinking block, and turn two begins with turn one's prompt and every generated token."""
    app, model = served("qwen3")
    client = _anthropic(app)
    kwargs = dict(model="tiny", system="You help.", tools=[ANTHROPIC_TOOL], thinking={"type": "enabled",
                  "budget_tokens": 1024})
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    model.say(FAMILIES["qwen3"][1])
    first = client.messages.create(**kwargs, max_tokens=80, messages=question, tool_choice={"type": "any"})
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    use = first.content[-1]
    model.say("Snow.")
    second = client.messages.create(**kwargs, max_tokens=8, messages=[
        *question, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Snow"}]}])
    usage = first.usage
    turn_one = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens + \
        usage.output_tokens
    # every block of turn one (its last token, the end of its turn, was never computed)
    assert second.usage.cache_read_input_tokens >= (turn_one - 1) // 16 * 16


def test_markers_that_are_special_tokens_stay_in_the_text_and_the_grammar_writes_them_as_tokens(tiny_models):
    """Ministral's `[THINK]`, `[TOOL_CALLS]`, `[ARGS]` are control tokens of its vocabulary (as harmony's are of
    gpt-oss's): the output text keeps them for the parsers, and the call grammar writes them as those tokens."""
    from tests.server.inprocess import tiny_tokenizer, with_tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.backend.add_special_tokens(["[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"])
    loaded = dataclasses.replace(with_tiny_tokenizer(tiny_models("llama-gqa")), tokenizer=tokenizer)
    loaded, model = scripted(loaded, (TEMPLATES / FAMILIES["ministral3"][0]).read_text())
    with serve_in_process(loaded) as app:
        model.say(f"[THINK]Hm.[/THINK][TOOL_CALLS]get_weather[ARGS]{OSLO}")
        assert tokenizer.encode("[THINK]", add_special_tokens=False) == [tokenizer.backend.token_to_id("[THINK]")]
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {  # (a 256-token context)
            "type": "object", "properties": {"city": {}}}}}
        reply = _client(app).chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Oslo?"}],
            tools=[tool], tool_choice="required", max_tokens=34)
    message = reply.choices[0].message
    assert message.reasoning_content == "Hm."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", OSLO)]


def test_responses_turn_two_holds_turn_one_with_its_reasoning_item_resent(served):
    """A stateless Responses tool loop resends the reasoning item before the function_call: Qwen3's template
    renders it back, and turn two hits every block of turn one."""
    app, model = served("qwen3")
    client = _client(app)
    kwargs = dict(model="tiny", instructions="You help.", tools=[{"type": "function", **WEATHER["function"]}],
                  reasoning={"effort": "medium"}, store=False)
    model.say(FAMILIES["qwen3"][1])
    first = client.responses.create(**kwargs, input="Weather in Oslo?", tool_choice="required", max_output_tokens=80)
    reasoning, call = first.output
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "reasoning", "id": reasoning.id, "summary": [],
              "content": [{"type": "reasoning_text", "text": reasoning.content[0].text}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Snow"}]
    model.say("Snow.")
    second = client.responses.create(**kwargs, input=items, max_output_tokens=8)
    turn_one = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (turn_one - 1) // 16 * 16
    assert second.output_text == "Snow."


def test_qwen3_with_thinking_off_drops_the_empty_thinking_from_history(served):
    """Qwen3's template closes the thinking in the generation prompt (`<think>\n\n</think>\n\n`) but renders an
    earlier tool-calling answer without it: turn two holds turn one's prompt, not its answer's place."""
    app, model = served("qwen3")
    body = {"model": "tiny", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80,
            "chat_template_kwargs": {"enable_thinking": False}}
    turn_one = app.post("/tokenize", json=body).json()["tokens"]
    model.say(f'<tool_call>\n{{"name": "get_weather", "arguments": {OSLO}}}\n</tool_call>')
    switch = {"chat_template_kwargs": body.pop("chat_template_kwargs")}
    call = _client(app).chat.completions.create(**body, extra_body=switch).choices[0].message.tool_calls[0]
    body.update(switch)
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "Snow"}]
    turn_two = app.post("/tokenize", json={**body, "messages": history}).json()["tokens"]
    generated = model.generated_ids
    assert turn_two[:len(turn_one) + len(generated)] != turn_one + generated
    assert _common(turn_one, turn_two) < len(turn_one)  # it parts at the generation prompt's closed thinking


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
