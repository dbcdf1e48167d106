"""Streaming sends the engine's deltas; non-streaming answers from the assembled finals: the two agree
(text, finish reasons, logprobs, usage) for long generations, stop strings, echo and several choices."""

import json

import pytest

from tests.server.inprocess import assert_idle_and_intact

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "The capital"}]


def stream(client, path, body) -> list[dict]:
    response = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def choices(chunks, index) -> list[dict]:
    return [choice for chunk in chunks for choice in chunk["choices"] if choice["index"] == index]


def joined(chunks, index, piece) -> str:
    return "".join(piece(choice) or "" for choice in choices(chunks, index))


def counts(usage: dict) -> tuple[int, int, int]:
    # Cached tokens differ: the second of the two requests finds the first one's prompt cached.
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def finishes(chunks, index) -> list[str]:
    return [choice["finish_reason"] for choice in choices(chunks, index) if choice["finish_reason"]]


def stop_string(text: str) -> str:
    """Two characters from the middle of a long greedy completion: a stop string that occurs."""
    assert len(text) > 12
    return text[10:12]


@pytest.fixture(scope="module")
def completion_stop(tiny_app):
    body = {"prompt": "The capital", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    return stop_string(tiny_app.post(COMPLETIONS, json=body).json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def chat_stop(tiny_app):
    body = {"messages": USER, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    return stop_string(tiny_app.post(CHAT, json=body).json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("extra,stop", [
    ({"max_tokens": 120, "ignore_eos": True}, False),
    ({"max_tokens": 40, "ignore_eos": True}, True),
    ({"max_tokens": 30, "echo": True, "n": 2}, False),
], ids=["long", "stop-string", "echo-n2"])
def test_completions_stream_joins_to_the_non_streaming_body(tiny_app, completion_stop, extra, stop):
    body = {"prompt": "The capital", "temperature": 0, "logprobs": 1, **extra}
    if stop:
        body["stop"] = completion_stop
    full = tiny_app.post(COMPLETIONS, json=body).json()
    chunks = stream(tiny_app, COMPLETIONS, body)
    for choice in full["choices"]:
        index = choice["index"]
        assert joined(chunks, index, lambda c: c["text"]) == choice["text"]
        assert finishes(chunks, index) == [choice["finish_reason"]]
        streamed = [c["logprobs"] for c in choices(chunks, index) if c["logprobs"]]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [value for logprobs in streamed for value in logprobs[key]] == choice["logprobs"][key]
    if stop:
        assert full["choices"][0]["finish_reason"] == "stop" and completion_stop not in full["choices"][0]["text"]
    assert counts(chunks[-1]["usage"]) == counts(full["usage"])


@pytest.mark.parametrize("stop", [False, True], ids=["long", "stop-string"])
def test_chat_stream_joins_to_the_non_streaming_body(tiny_app, chat_stop, stop):
    body = {"messages": USER, "temperature": 0, "logprobs": True, "max_tokens": 40 if stop else 100,
            "ignore_eos": True}
    if stop:
        body["stop"] = chat_stop
    full = tiny_app.post(CHAT, json=body).json()
    chunks = stream(tiny_app, CHAT, body)
    choice = full["choices"][0]
    assert joined(chunks, 0, lambda c: c["delta"].get("content")) == choice["message"]["content"]
    assert finishes(chunks, 0) == [choice["finish_reason"]]
    streamed = [item for c in choices(chunks, 0) if c["logprobs"] for item in c["logprobs"]["content"]]
    assert streamed == choice["logprobs"]["content"]
    assert counts(chunks[-1]["usage"]) == counts(full["usage"])
    if stop:
        assert choice["finish_reason"] == "stop" and chat_stop not in choice["message"]["content"]


def test_the_streams_leave_the_app_idle_and_intact(tiny_app):
    assert_idle_and_intact(tiny_app)
