"""Issue 11's API edges, reproduced in process on a tiny model: malformed input is a 400 naming the
field, body and prompt-length limits, batch limits vs 429, echo logprobs, prompt_logprobs, the schema."""

import json

import pytest

from kvserve.engine.async_engine import AsyncEngine
from tests.server.inprocess import assert_idle_and_intact

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]


def post_json(client, path, body):
    # json.dumps writes a lone surrogate as "\ud800" and floats as NaN/Infinity, as a hostile client can.
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def assert_error(response, status, fragment, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --- issue 11 item 2: malformed input is a 400 naming the field, never a 500 ----------------------


@pytest.mark.parametrize("path,body,fragment,param", [
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, "seed must be an integer in [-2**63, 2**64 - 1]", "seed"),
    (COMPLETIONS, {"prompt": "hi", "seed": -(2**63) - 1}, "seed must be an integer in", "seed"),
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt: contains a lone surrogate (U+D800)", "prompt"),
    (COMPLETIONS, {"prompt": ["fine", "bad \udfff"]}, "prompt.1: contains a lone surrogate", "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["\ud800"]}, "stop.0: contains a lone surrogate", "stop"),
    (COMPLETIONS, {"prompt": "hi", "model": "m\ud800"}, "model: contains a lone surrogate", "model"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]},
     "messages.0.content: contains a lone surrogate (U+D800) at character 1", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "contains a lone surrogate", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": "\udc00"}, "stop: contains a lone surrogate",
     "stop"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages.0.content.0: images are not supported", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}]},
     "messages.0.content.1: input_audio content parts are not supported", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a text content part needs `text`",
     "messages"),
    # Numerically hostile sampling values are refused with their bound (1e-40 overflowed the logits).
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e-40, "temperature": 1},
     "repetition_penalty must be in [0.01, 100]", "repetition_penalty"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e39}, "repetition_penalty must be in", "repetition_penalty"),
    (COMPLETIONS, {"prompt": "hi", "temperature": float("inf")}, "temperature must be >= 0 and <= 100", "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": float("nan")}, "top_p must be in (0, 1]", "top_p"),
    (COMPLETIONS, {"prompt": "hi", "n": 129}, "n must be <= 128", "n"),
])
def test_malformed_input_is_a_400_naming_the_field(tiny_app, path, body, fragment, param):
    assert_error(post_json(tiny_app, path, body), 400, fragment, param)


def test_several_choices_with_the_largest_seed_run(tiny_app):
    """Choice seeds are the seed + the choice index, wrapped into the generator's range."""
    body = {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**64 - 1, "temperature": 1}
    response = post_json(tiny_app, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1]


# --- item 3: body limit, and prompts refused by length before they are tokenized ------------------


def test_body_over_the_limit_is_413_with_the_limit(tiny_app):
    body = json.dumps({"prompt": "x" * 100_000}).encode()  # the app's limit is 64 KiB
    error = assert_error(tiny_app.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"}),
                         413, "limit of 65,536 bytes (--max-request-bytes)")
    assert error["code"] == "request_too_large"
    assert f"({len(body):,} bytes)" in error["message"]  # refused from Content-Length, before reading


def test_chunked_body_over_the_limit_is_413_while_reading(tiny_app):
    chunks_sent = []

    def chunks():  # no Content-Length: the limit is found while reading
        for i in range(64):
            chunks_sent.append(i)
            yield b" " * 4096

    response = tiny_app.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "limit of 65,536 bytes")


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(tiny_app, monkeypatch):
    tokenizer = tiny_app.app.state.async_engine.engine.tokenizer
    encoded = []
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, text, *a, **k: encoded.append(len(text)) or [])
    # 256-token context x 13 characters per token at most ("<|endoftext|>") = 3,328 characters.
    assert_error(post_json(tiny_app, COMPLETIONS, {"prompt": "x" * 3329}), 400, "3,329 characters", "prompt")
    assert_error(post_json(tiny_app, CHAT, {"messages": [{"role": "user", "content": "x" * 2000}] * 2}), 400,
                 "messages is 4,000 characters: more than any prompt that fits the model's context of 256 tokens")
    assert encoded == []


def test_the_length_estimate_never_refuses_a_prompt_that_fits(tiny_app):
    # 250 tokens of 13 characters each: 3,250 characters that do fit.
    prompt = "<|endoftext|>" * 250
    response = post_json(tiny_app, COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 250


# --- item 5: more than the server can ever queue is a 400; a full queue is a 429 with Retry-After ---


def test_batches_beyond_the_queue_are_400_naming_the_limit(tiny_app):
    error = assert_error(post_json(tiny_app, COMPLETIONS, {"prompt": "hi", "n": 9}), 400,
                         "needs 9 completions (prompts x n) but the server queues at most 8", "n")
    assert "--max-waiting-requests" in error["message"]
    assert_error(post_json(tiny_app, COMPLETIONS, {"prompt": ["a"] * 1000}), 400, "needs 1000 completions", "prompt")
    assert_error(post_json(tiny_app, CHAT, {"messages": USER_HI, "n": 9}), 400, "queues at most 8", "n")


def test_a_full_queue_is_429_with_retry_after(tiny_app, monkeypatch):
    monkeypatch.setattr(AsyncEngine, "num_waiting", property(lambda self: 7))
    response = post_json(tiny_app, COMPLETIONS, {"prompt": "hi", "n": 2, "max_tokens": 1})
    assert_error(response, 429, "7 requests waiting, limit 8")
    assert response.headers["Retry-After"] == "1"
    assert post_json(tiny_app, COMPLETIONS, {"prompt": "hi", "max_tokens": 1}).status_code == 200  # 1 fits


# --- item 4: echo + logprobs, and prompt_logprobs in vLLM's shape -----------------------------------


def test_echo_logprobs_give_the_first_token_and_true_offsets(tiny_app):
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0}
    choice = post_json(tiny_app, COMPLETIONS, body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][:3] == ["The", " capital", " "]
    assert logprobs["text_offset"][:3] == [0, 3, 11]
    assert logprobs["token_logprobs"][0] is None and None not in logprobs["token_logprobs"][1:]
    # Every offset is where its token's text starts in the choice's text.
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert choice["text"][offset:offset + len(token)] == token

    chunks = _stream_chunks(tiny_app, {**body, "stream": True})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for lp in streamed for t in lp["tokens"]] == logprobs["tokens"]
    assert [o for lp in streamed for o in lp["text_offset"]] == logprobs["text_offset"]


def test_prompt_logprobs_are_returned_in_vllms_shape(tiny_app):
    tokenizer = tiny_app.app.state.async_engine.engine.tokenizer
    prompt_ids = tokenizer.encode("The capital")
    for path, body in ((COMPLETIONS, {"prompt": "The capital"}),
                       (CHAT, {"messages": [{"role": "user", "content": "The capital"}]})):
        response = post_json(tiny_app, path, {**body, "max_tokens": 1, "prompt_logprobs": 2})
        positions = response.json()["choices"][0]["prompt_logprobs"]
        assert positions[0] is None and all(positions[1:])
        for position in positions[1:]:
            assert 2 <= len(position) <= 3  # the top 2, plus the prompt token if it is not among them
            ranks = sorted(entry["rank"] for entry in position.values() if entry["rank"] is not None)
            assert ranks[:2] == [1, 2]
            assert all(set(entry) == {"logprob", "rank", "decoded_token"} and entry["logprob"] <= 0
                       for entry in position.values())
        if path == COMPLETIONS:
            assert len(positions) == len(prompt_ids)
            for token_id, position in zip(prompt_ids[1:], positions[1:]):
                assert position[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
    # Not requested: not there.
    plain = post_json(tiny_app, COMPLETIONS, {"prompt": "The capital", "max_tokens": 1}).json()["choices"][0]
    assert "prompt_logprobs" not in plain
    assert_error(post_json(tiny_app, COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}), 400,
                 "not available with stream=true", "prompt_logprobs")


def _stream_chunks(client, body):
    text = client.post(COMPLETIONS, json=body).text
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# --- item 8: the OpenAPI schema states bounds and the status codes the server uses -----------------


def test_openapi_states_bounds_and_real_status_codes(tiny_app):
    schema = tiny_app.get("/openapi.json").json()
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["max_tokens"]["minimum"] == 1
    assert (fields["n"]["minimum"], fields["n"]["maximum"]) == (1, 128)
    assert (fields["top_p"]["exclusiveMinimum"], fields["top_p"]["maximum"]) == (0, 1)
    assert fields["temperature"]["minimum"] == 0
    assert (fields["presence_penalty"]["minimum"], fields["presence_penalty"]["maximum"]) == (-2, 2)
    assert (fields["frequency_penalty"]["minimum"], fields["frequency_penalty"]["maximum"]) == (-2, 2)
    assert (fields["logprobs"]["minimum"], fields["logprobs"]["maximum"]) == (0, 20)
    # FastAPI's OpenAPI model keeps bounds as floats: 2**64 - 1 reads back rounded.
    assert (fields["seed"]["minimum"], fields["seed"]["maximum"]) == pytest.approx((-(2**63), 2**64 - 1))
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert (chat["top_logprobs"]["minimum"], chat["top_logprobs"]["maximum"]) == (0, 20)
    assert chat["max_completion_tokens"]["minimum"] == 1
    for path in (COMPLETIONS, CHAT):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500"} <= set(responses) and "422" not in responses
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert tiny_app.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("path,body,fragment", [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text: Input should be a valid string"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt.1: Input should be a valid integer"),
    (COMPLETIONS, {"prompt": 5}, "prompt: Input should be a valid string"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role: Input should be"),
])
def test_type_errors_point_inside_the_value(tiny_app, path, body, fragment):
    assert_error(post_json(tiny_app, path, body), 400, fragment)


def test_a_chat_template_that_refuses_the_messages_is_a_400(tiny_app, monkeypatch):
    tokenizer = tiny_app.app.state.async_engine.engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    assert_error(post_json(tiny_app, CHAT, {"messages": USER_HI}), 400,
                 "the model's chat template refused these messages: roles must alternate", "messages")


def test_the_edges_leave_the_app_idle_and_intact(tiny_app):
    assert_idle_and_intact(tiny_app)
