"""Hypothesis over request bodies against the app in process: never a 5xx, and healthy after.

Most bodies are well-formed with at most one hostile field (a wrong type, a huge or non-finite
number, a lone surrogate, an image part, garbage JSON), so that validation and generation are
both exercised; the rest are arbitrary JSON or bytes. Generation stays short (max_tokens <= 4,
n <= 3; the app has 8 waiting places), so 200 examples run in seconds on the tiny model.
"""

import copy
import functools
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.sample.sampling import SEED_RANGE
from tests.server.inprocess import assert_idle_and_intact

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=8)
HOSTILE_NUMBER = st.one_of(st.sampled_from([0, -1, 1.5, 2**63, 2**64, -(2**64), 10**30, 1e308, 1e-320,
                                            float("nan"), float("inf"), float("-inf"), "1", True]), JSON_VALUES)
HOSTILE_STRING = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "", "\x00", "<|im_end|>", "é😀", "x" * 5000])
HOSTILE_TEXT = st.one_of(HOSTILE_STRING, JSON_VALUES)
TEXT = st.text(min_size=1, max_size=30)
TOKEN_IDS = st.lists(st.integers(0, 159), min_size=1, max_size=20)

# Field -> (well-formed values, hostile values).
SAMPLING = {
    "max_tokens": (st.integers(1, 4), st.one_of(st.sampled_from([0, -1, 300, 2**64]), HOSTILE_NUMBER)),
    "n": (st.integers(1, 3), st.one_of(st.sampled_from([0, 9, 129, 2**63]), HOSTILE_NUMBER)),
    "temperature": (st.floats(0, 2), HOSTILE_NUMBER),
    # Down to 1e-300 (well-formed: it is in (0, 1]): it rounds to 0 in float32, and the sampler
    # still keeps the top token.
    "top_p": (st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([1e-300, 5e-324])), HOSTILE_NUMBER),
    "top_k": (st.integers(-1, 200), HOSTILE_NUMBER),
    "min_p": (st.floats(0, 1), HOSTILE_NUMBER),
    "repetition_penalty": (st.floats(0.01, 100), st.one_of(st.floats(1e-45, 1e-2), st.floats(100, 1e40),
                                                            HOSTILE_NUMBER)),
    "presence_penalty": (st.floats(-2, 2), HOSTILE_NUMBER),
    "frequency_penalty": (st.floats(-2, 2), HOSTILE_NUMBER),
    "seed": (st.integers(*SEED_RANGE), st.one_of(st.sampled_from([SEED_RANGE[0] - 1, SEED_RANGE[1] + 1]),
                                                 HOSTILE_NUMBER)),
    "stop": (st.one_of(TEXT, st.lists(TEXT, max_size=2)), st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_TEXT, max_size=2))),
    "stop_token_ids": (st.lists(st.integers(0, 159), max_size=2), st.one_of(st.lists(HOSTILE_NUMBER), JSON_VALUES)),
    "stream": (st.booleans(), JSON_VALUES),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUES),
    "ignore_eos": (st.booleans(), JSON_VALUES),
    "skip_special_tokens": (st.booleans(), JSON_VALUES),
    "cache_salt": (TEXT, HOSTILE_TEXT),
    "model": (st.just("tiny"), HOSTILE_TEXT),
    "user": (TEXT, HOSTILE_TEXT),
    "logit_bias": (st.none(), JSON_VALUES),
    "prompt_logprobs": (st.integers(0, 5), HOSTILE_NUMBER),
}
COMPLETION = {
    **SAMPLING,
    "prompt": (st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, min_size=1, max_size=2),
                         st.lists(TOKEN_IDS, min_size=1, max_size=2)),
               st.one_of(HOSTILE_TEXT, st.lists(st.integers()), st.lists(HOSTILE_TEXT, max_size=3))),
    "echo": (st.booleans(), JSON_VALUES),
    "logprobs": (st.integers(0, 5), HOSTILE_NUMBER),
    "suffix": (st.none(), HOSTILE_TEXT),
    "best_of": (st.none(), HOSTILE_NUMBER),
}
CONTENT_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file", "refusal", "text"]),
                           "image_url": st.just({"url": "http://x/y.png"})}),
    st.fixed_dictionaries({"type": st.just("text"), "text": HOSTILE_TEXT}),
    JSON_VALUES,
)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": TEXT})
HOSTILE_MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "tool"]), HOSTILE_TEXT),
                                         "content": st.one_of(HOSTILE_TEXT, st.lists(CONTENT_PART, max_size=3))})
CHAT = {
    **SAMPLING,
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3),
                 st.one_of(st.lists(st.one_of(MESSAGE, HOSTILE_MESSAGE), min_size=1, max_size=3), JSON_VALUES)),
    "max_completion_tokens": SAMPLING["max_tokens"],
    "logprobs": (st.booleans(), JSON_VALUES),
    "top_logprobs": (st.integers(0, 5), HOSTILE_NUMBER),
    "tools": (st.none(), JSON_VALUES),
    "response_format": (st.just({"type": "text"}), JSON_VALUES),
    "add_generation_prompt": (st.booleans(), JSON_VALUES),
}


def bodies(fields: dict, required: tuple[str, ...]):
    """Well-formed values for the required fields and some optional ones; then, two times in three,
    one thing made hostile: a field's whole value, or one string or number inside the body."""
    well_formed = st.fixed_dictionaries({k: fields[k][0] for k in required},
                                        optional={k: v[0] for k, v in fields.items() if k not in required})
    override = st.sampled_from(sorted(fields)).flatmap(lambda k: st.tuples(st.just(k), fields[k][1]))
    return well_formed.map(_consistent).flatmap(lambda body: st.one_of(
        st.just(body),
        override.map(lambda item: {**body, item[0]: item[1]}),
        _mutate_one_leaf(body),
    ))


def _consistent(body: dict) -> dict:
    """Well-formed fields that are valid together: stream options and prompt logprobs need
    stream=true and stream=false."""
    body.pop("stream_options" if not body.get("stream") else "prompt_logprobs", None)
    return body


def _mutate_one_leaf(body: dict):
    leaves = list(_leaves(body))
    if not leaves:
        return st.just(body)

    def mutate(path, value):
        mutated = copy.deepcopy(body)
        *parents, last = path
        functools.reduce(lambda node, key: node[key], parents, mutated)[last] = value
        return mutated

    return st.sampled_from(leaves).flatmap(lambda leaf: st.builds(
        mutate, st.just(leaf[0]), HOSTILE_STRING if isinstance(leaf[1], str) else HOSTILE_NUMBER))


def _leaves(node, path=()):
    """(path, value) of every string and number in a JSON value."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list)):
            yield from _leaves(value, path + (key,))
        else:
            yield path + (key,), value


PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
CHAT_REQUEST = st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, ("messages", "max_tokens")).map(json.dumps))
COMPLETION_REQUEST = st.tuples(st.just("/v1/completions"), bodies(COMPLETION, ("prompt",)).map(json.dumps))
REQUESTS = st.one_of(
    # Chat's default max_tokens is the whole context: keep it bounded unless it is the hostile field.
    CHAT_REQUEST, CHAT_REQUEST, COMPLETION_REQUEST, COMPLETION_REQUEST,
    st.tuples(PATHS, JSON_VALUES.map(json.dumps)),
    st.tuples(PATHS, st.binary(max_size=40)),
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=REQUESTS)
def test_no_request_body_makes_a_5xx(tiny_app, request):
    path, body = request
    response = tiny_app.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and response.status_code in (400, 404), error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"server_error"' not in response.text, response.text
    else:
        assert response.json()["choices"], response.text


def test_the_app_is_healthy_after_the_fuzz(tiny_app):
    assert_idle_and_intact(tiny_app)
