"""Ollama's API through the official `ollama` client against a real server on the embedded model: the listing
routes, chat and generate (streamed and whole), tools, `format`, `think`, the refusals, cancel, and a chat
resent turn by turn that caches each previous turn."""

import json

import httpx
import ollama
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base_url)


def test_listing_routes_describe_the_served_model(server, client):
    assert httpx.get(server.base_url + "/").text == "Ollama is running"
    assert httpx.head(server.base_url + "/").status_code == 200
    assert httpx.get(server.base_url + "/api/version").json()["version"]
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size > 0 and listed.details.family == "llama"
    shown = client.show(MODEL + ":latest")
    assert {"completion", "tools"} <= set(shown.capabilities) and "thinking" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert "im_start" in shown.template
    (running,) = client.ps().models
    assert running.model == MODEL and running.context_length == 8192


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY, stream=False)
    parts = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 12
    assert whole.prompt_eval_count > 0 and whole.total_duration > whole.eval_duration > 0
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and parts[-1].eval_count == 12


def test_generate_with_the_template_and_raw(client):
    templated = client.generate(model=MODEL, prompt="Name a colour.", system="Be brief.", options=GREEDY)
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    assert templated.done and templated.response and raw.response
    streamed = "".join(p.response for p in client.generate(model=MODEL, prompt="Name a colour.", system="Be brief.",
                                                            options=GREEDY, stream=True))
    assert streamed == templated.response
    assert client.generate(model=MODEL).done_reason == "load"  # Ollama's "load the model" call


def test_format_follows_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "Capital of France as JSON."}],
                        format=schema, options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(reply.message.content)) == {"city"}


def test_tool_calls_come_back_as_objects_and_a_tool_loop_stays_cached(client):
    get_weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    # The 135M model seldom decides to call by itself; a user turn that opens the call layout makes it write
    # calls (the grammar makes each one valid). It goes on calling until num_predict: the cut last call is
    # left out (Ollama's arguments are an object) and done_reason says "length".
    messages = [{"role": "user", "content": "<tool_call>"}]
    reply = client.chat(model=MODEL, messages=messages, tools=[get_weather], options={"temperature": 0,
                                                                                       "num_predict": 60})
    calls = reply.message.tool_calls or []
    assert calls and reply.done_reason == "length"
    assert all(c.function.name == "get_weather" and set(c.function.arguments) == {"city"} for c in calls)
    loop = [*messages, reply.message] + [{"role": "tool", "content": "Sunny", "tool_name": "get_weather"}
                                         for _ in calls]
    second = client.chat(model=MODEL, tools=[get_weather], options=GREEDY, messages=loop)
    third = client.chat(model=MODEL, tools=[get_weather], options=GREEDY, messages=[
        *loop, second.message, {"role": "user", "content": "Thanks."}])
    # the resent loop (calls, results, answer) was cached: only the last partial block and the new turn ran
    assert third.prompt_eval_count <= 16 + 20, third.prompt_eval_count


def test_think_is_refused_by_a_model_without_thinking(client):
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], think=True)
    assert error.value.status_code == 400 and "does not support thinking" in error.value.error


def test_refusals_in_ollamas_shape(server, client):
    for call, status in ((lambda: client.pull("llama3"), 403), (lambda: client.embed(model=MODEL, input="x"), 501),
                         (lambda: client.delete(MODEL), 403), (lambda: client.chat(model="other", messages=[]), 404)):
        with pytest.raises(ollama.ResponseError) as error:
            call()
        assert error.value.status_code == status, error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert error.value.status_code == 400 and "images" in error.value.error
    bad = httpx.post(server.base_url + "/api/chat", content=b"{not json")
    assert bad.status_code in (400, 422) and "error" in bad.json()


def test_cancel_mid_stream_frees_every_block(server, client):
    stream = client.chat(model=MODEL, messages=[{"role": "user", "content": "Count to a hundred."}],
                         options={"temperature": 0, "num_predict": 400}, stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    report = server.wait_idle()
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok"


def test_a_chat_resent_turn_by_turn_caches_each_previous_turn(client):
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in one sentence."}]
    for turn, question in enumerate(["What is a cache?", "Why is it fast?", "Name one kind.", "Thanks!"]):
        messages.append({"role": "user", "content": question})
        reply = client.chat(model=MODEL, messages=messages, options=GREEDY)
        if turn:  # everything before this turn's question was cached but its last partial block
            assert reply.prompt_eval_count <= 16 + 24, (turn, reply.prompt_eval_count)
        messages.append({"role": "assistant", "content": reply.message.content})
