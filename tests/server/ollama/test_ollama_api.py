"""Ollama's API in process on a tiny random model: `options` onto sampling, calls without ids matched to their
results, `think` on a template that knows thinking, tenants, and the shape of errors."""

import ollama
import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.ollama.protocol import ChatRequest, GenerateRequest, call_id
from tests.server.inprocess import serve_in_process, with_tiny_tokenizer

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def app(tiny_models):
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    loaded.tokenizer.chat_template = THINKING_TEMPLATE
    with serve_in_process(loaded, api_keys=["alice-key"]) as client:
        yield client


@pytest.fixture(scope="module")
def client(app):
    """The official client over the in-process app (a TestClient is an httpx.Client)."""
    client = ollama.Client(host="http://testserver")
    app.headers["Authorization"] = "Bearer alice-key"
    client._client = app
    return client


def test_options_map_onto_sampling_with_ollamas_defaults():
    body = GenerateRequest(model="m", prompt="x", options={
        "temperature": 0.2, "repeat_penalty": 1.3, "stop": "END", "seed": 7, "mirostat": 2})  # mirostat: ignored
    params = body.sampling(5, None)
    assert (params.temperature, params.repetition_penalty, params.stop, params.seed) == (0.2, 1.3, ["END"], 7)
    assert (params.top_k, params.top_p) == (40, 0.9)  # Ollama's defaults where the request gives none
    assert GenerateRequest(model="m", prompt="x").sampling(5, None).temperature == 0.8
    assert GenerateRequest(model="m", options={"num_predict": -2}).requested_max_tokens(99) == 99
    assert GenerateRequest(model="m", options={"num_predict": -1}).requested_max_tokens(99) is None
    with pytest.raises(InvalidRequestError) as error:
        GenerateRequest(model="m", options={"temperature": -1}).sampling(5, None)
    assert error.value.param == "options.temperature"
    assert GenerateRequest(model="m", format="json").format_constraint().json_object


def test_calls_get_ids_from_their_content_and_results_match_them_in_order():
    body = ChatRequest(model="m", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]},
        {"role": "tool", "content": "B", "tool_name": "b"}, {"role": "tool", "content": "A"}])
    turns = body.to_conversation(body.tool_use(), "t", {}).turns
    assert turns[1].tool_calls[0].id == call_id("a", '{"x": 1}')  # as the generated call's id is made
    assert [(t.tool_call_id, t.content) for t in turns[2:]] == [(call_id("b", "{}"), "B"), (call_id("a", '{"x": 1}'), "A")]
    orphan = ChatRequest(model="m", messages=[{"role": "tool", "content": "?"}])
    with pytest.raises(InvalidRequestError, match="answers no earlier tool call"):
        orphan.to_conversation(orphan.tool_use(), "t", {})


def test_think_puts_the_thinking_apart_and_think_false_switches_it_off(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], options={"temperature": 0,
                                                                                      "num_predict": 8})
    assert "thinking" in client.show("tiny").capabilities
    thought = client.chat(**kwargs, think=True)
    assert thought.message.thinking and not thought.message.content  # the template opened it; never closed
    streamed = list(client.chat(**kwargs, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed) == thought.message.thinking
    plain = client.chat(**kwargs, think=False)
    assert plain.message.content and not plain.message.thinking


def test_a_key_is_required_and_errors_are_in_ollamas_shape(app):
    no_key = app.post("/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                      headers={"Authorization": ""})
    assert no_key.status_code == 401 and set(no_key.json()) == {"error"}
    unknown = app.post("/api/show", json={"model": "llama3"}, headers={"Authorization": "Bearer alice-key"})
    assert unknown.status_code == 404 and "llama3" in unknown.json()["error"]
    too_long = app.post("/api/generate", headers={"Authorization": "Bearer alice-key"},
                        json={"model": "tiny", "prompt": "word " * 400, "stream": False})
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]
