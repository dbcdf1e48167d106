"""The OpenAI-compatible API through the official `openai` client against a real server."""

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_chat_non_streaming_and_streaming_agree(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == full.usage.completion_tokens


def test_completions_streaming_matches_non_streaming(client, model):
    kwargs = dict(model=model, prompt="The three primary colors are", max_tokens=12, temperature=0, logprobs=1)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == full.choices[0].text
    assert [p.finish_reason for p in pieces if p.finish_reason] == [full.choices[0].finish_reason]
    streamed_logprobs = [lp for p in pieces if p.logprobs for lp in p.logprobs.token_logprobs]
    # The second request may verify drafts learned from the first one's output (speculative decoding is on
    # by default): the same tokens, from a forward of another shape, so equal within float noise.
    assert streamed_logprobs == pytest.approx(full.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_repeated_chat_reports_cached_prompt_tokens(client, model):
    messages = [{"role": "user", "content": "Explain in one sentence why the sky looks blue during the day, "
                                            "and mention the name of the scattering involved."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached % 16 == 0  # whole blocks


def test_seeded_sampling_is_reproducible(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_completions_with_token_ids_echo_and_batches(client, model, embedded_tokenizer):
    by_text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    token_ids = embedded_tokenizer.encode("The capital of France is")
    ids = client.completions.create(model=model, prompt=token_ids, max_tokens=5, temperature=0)
    assert by_text.usage.prompt_tokens == ids.usage.prompt_tokens == len(token_ids)
    assert ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + by_text.choices[0].text
    batch = client.completions.create(model=model, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    # Prompt tokens count once per prompt, not per choice.
    assert batch.usage.prompt_tokens == len(embedded_tokenizer.encode("Hello")) + len(embedded_tokenizer.encode("Goodbye"))


def test_n_choices_with_seed_differ(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=1, n=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1
    assert out.usage.completion_tokens <= 3 * 12


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely

    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)

    echoed = client.completions.create(model=model, prompt="The capital of France is", max_tokens=2,
                                       temperature=0, logprobs=0, echo=True)
    lp = echoed.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.token_logprobs) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    # The first prompt token has its text (only its logprob is None), so the offsets are true.
    assert lp.tokens[:3] == ["The", " capital", " of"] and lp.text_offset[:3] == [0, 3, 11]


def test_stop_strings_end_with_finish_reason_stop(client, model):
    out = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
    assert out.choices[0].finish_reason == "stop"
    assert " 7" not in out.choices[0].text and "6" in out.choices[0].text


def test_max_completion_tokens_and_ignore_eos(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 40 and out.choices[0].finish_reason == "length"


# --- errors: status and OpenAI's body -------------------------------------------------------------


def post(server, path, **kwargs):
    return httpx.post(server.api_url + path, timeout=30, **kwargs)


def assert_error(response, status, fragment):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error["message"]
    return error


@pytest.mark.parametrize("body,fragment", [
    ({"messages": "hi"}, "messages"),
    ({"model": "x"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "0.7"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature must be >= 0"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n must be >= 1"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_bad_fields_are_400(server, body, fragment):
    assert_error(post(server, "/chat/completions", json=body), 400, fragment)


def test_invalid_json_is_400(server):
    response = post(server, "/completions", content=b'{"prompt": "hi",', headers={"Content-Type": "application/json"})
    assert_error(response, 400, "not valid JSON")


def test_prompt_over_the_context_is_400_with_counts(server):
    response = post(server, "/completions", json={"prompt": [1] * 8000, "max_tokens": 500})
    error = assert_error(response, 400, "8000 tokens")
    assert "8192" in error["message"]


def test_bad_token_id_and_empty_prompt_are_400(server):
    assert_error(post(server, "/completions", json={"prompt": [1, 10**7]}), 400, "outside the vocabulary")
    assert_error(post(server, "/completions", json={"prompt": ""}), 400, "empty")


def test_a_twenty_megabyte_body_is_413_at_once(server):
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 20_000_000 + b'"}]}'
    response = post(server, "/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = assert_error(response, 413, "limit of 4,194,304 bytes (--max-request-bytes)")
    assert error["code"] == "request_too_large"
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"


def test_bad_requests_leave_the_server_healthy_and_leak_nothing(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    report = server.wait_idle()
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok"
