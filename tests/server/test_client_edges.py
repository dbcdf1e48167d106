"""Issue 27's edges, each reproduced against a real `kvserve serve` (embedded model) as the issue found
them with the official clients: tenants `ka` and `kb`, an admin key, a metrics key and a default
output cap on one server; the uncapped case on an open one."""

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CAP = 8  # --default-max-tokens
KA, KB, ADMIN, METRICS = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}, \
    {"Authorization": "Bearer adm"}, {"Authorization": "Bearer mk"}
HI = [{"role": "user", "content": "Hi"}]
SYSTEM = ("You are a meticulous assistant for a KV-cache engine. Answer briefly, precisely and politely, "
          "and explain block sharing, pinning and eviction when asked about them in any detail at all.")


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("edges"), "--api-key", "ka", "--api-key", "kb",
                          "--admin-key", "adm", "--metrics-key", "mk", "--default-max-tokens", str(CAP),
                          "--served-model-name", MODEL, api_key="ka")
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log()


def post(server, path, body, headers=KA):
    return httpx.post(server.base_url + path, headers={"Content-Type": "application/json", **headers},
                      content=json.dumps(body), timeout=120)


def anthropic_client(server, key="ka"):
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def openai_client(server, key="ka"):
    return openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0)


def assert_anthropic_error(response, status, kind, fragment=""):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert fragment in body["error"]["message"], body


# --- 1: Messages without max_tokens is a 400 (it was a 500), and the schema requires it -----------


@pytest.mark.parametrize("stream", [False, True])
def test_messages_without_max_tokens_is_a_400_naming_it(edges, stream):
    response = post(edges, "/v1/messages", {"model": MODEL, "messages": HI, "stream": stream},
                    headers={"x-api-key": "ka"})
    assert_anthropic_error(response, 400, "invalid_request_error", "max_tokens")
    assert "Field required" in response.json()["error"]["message"]
    schema = httpx.get(edges.base_url + "/openapi.json").json()["components"]["schemas"]["MessagesRequest"]
    assert "max_tokens" in schema["required"]


# --- 2: an explicit null is the default ------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n": None, "presence_penalty": None,
                              "frequency_penalty": None, "logprobs": None, "stream": None}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": None, "echo": None}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "store": None, "stream": None}),
])
def test_null_means_the_default(edges, path, body):
    response = post(edges, path, {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    answer = response.json()
    if path == "/v1/responses":
        assert answer["store"] is True  # the default: stored, and readable again
        assert httpx.get(f"{edges.api_url}/responses/{answer['id']}", headers=KA).status_code == 200
    else:
        assert len(answer["choices"]) == 1


# --- 3: the endpoints clients call exist; the others are named as unsupported ----------------------


def test_models_retrieve_and_count_tokens(edges):
    client = openai_client(edges)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    messages = anthropic_client(edges)
    counted = messages.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HI)
    usage = messages.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=HI).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens + \
        usage.cache_creation_input_tokens > 0


def test_an_unimplemented_endpoint_is_a_404_in_its_apis_shape(edges):
    response = post(edges, "/v1/embeddings", {"model": MODEL, "input": "Hi"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert "/v1/embeddings is not supported" in error["message"] and error["code"] == "unsupported_endpoint"
    response = post(edges, "/v1/messages/batches", {"requests": []}, headers={"x-api-key": "ka"})
    assert_anthropic_error(response, 404, "not_found_error", "/v1/messages/batches is not supported")


# --- 4: Anthropic's error shape on /v1/messages ---------------------------------------------------


def test_messages_errors_come_in_anthropics_shape(edges):
    body = {"model": MODEL, "max_tokens": 2, "messages": HI}
    response = post(edges, "/v1/messages", body, headers={"x-api-key": "wrong"})
    assert_anthropic_error(response, 401, "authentication_error", "x-api-key")
    assert_anthropic_error(post(edges, "/v1/messages", {**body, "model": "claude-x"}, headers={"x-api-key": "ka"}),
                           404, "not_found_error", "claude-x")
    assert_anthropic_error(post(edges, "/v1/messages", {**body, "max_tokens": 0}, headers={"x-api-key": "ka"}),
                           400, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(edges, "wrong").messages.create(**body)
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(edges).messages.create(**{**body, "model": "claude-x"})


# --- 5: errors name the field the request used -----------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"input": "Hi", "max_output_tokens": -5}, "max_output_tokens"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": -1}, "max_completion_tokens"),
])
def test_errors_name_the_requests_own_field(edges, path, body, param):
    response = post(edges, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


# --- 6: the schema and the checks agree -------------------------------------------------------------


def test_schema_and_validation_are_one_truth(edges):
    schemas = httpx.get(edges.base_url + "/openapi.json").json()["components"]["schemas"]
    # Refused, and the schema says so.
    assert post(edges, "/v1/completions", {"prompt": ""}).status_code == 400
    assert {"type": "string", "minLength": 1} in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert post(edges, "/v1/responses", {"input": ""}).status_code == 400
    assert {"type": "string", "minLength": 1} in schemas["ResponsesRequest"]["properties"]["input"]["anyOf"]
    block = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert post(edges, "/v1/messages", block, headers={"x-api-key": "ka"}).status_code == 400
    assert "text" in schemas["TextBlock"]["required"]
    response = post(edges, "/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 1})
    assert response.status_code == 400 and "a user message needs `content`" in response.text
    assert schemas["ChatMessage"]["if"]["properties"]["role"]["enum"] == ["system", "developer", "user"]
    # An assistant turn may come without content (OpenAI's), and the model may be left out (vLLM's: the one served).
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "?"}]
    assert post(edges, "/v1/chat/completions", {"messages": turns, "max_tokens": 1}).status_code == 200
    assert "model" not in schemas["ChatCompletionRequest"].get("required", [])


# --- 7: a tenant sees its own pins and nothing of another's ----------------------------------------


def test_a_tenant_sees_its_own_pins_and_no_one_elses(edges):
    def pin(key, text):
        return anthropic_client(edges, key).messages.create(model=MODEL, max_tokens=1, system=[
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}], messages=HI)

    pin("ka", SYSTEM)
    pin("kb", SYSTEM + " Bob's own preamble differs.")
    mine, theirs = (httpx.get(edges.api_url + "/kv_cache", headers=h).json() for h in (KA, KB))
    whole = httpx.get(edges.api_url + "/kv_cache", headers=ADMIN).json()
    assert whole["visible_to"] == "admin" and whole["pins"]["num_pins"] >= 2
    assert mine["visible_to"] == theirs["visible_to"] == "tenant"
    keys = {p["key"] for p in whole["pins"]["pins"]}
    mine_keys, theirs_keys = {p["key"] for p in mine["pins"]["pins"]}, {p["key"] for p in theirs["pins"]["pins"]}
    assert mine_keys and theirs_keys and not mine_keys & theirs_keys and mine_keys | theirs_keys <= keys
    assert mine["pins"]["num_pins"] == len(mine_keys)
    for report in (mine, theirs):  # the pool's history of everyone's traffic is the admin's
        for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "tier"):
            assert name not in report
        assert set(report["pins"]) == {"num_pins", "num_pinned_blocks", "max_pinned_blocks", "pins"}
        assert report["integrity"] == "ok" and report["num_blocks"] == whole["num_blocks"]


def test_metrics_needs_the_metrics_key_or_the_admin_key(edges):
    for headers, status in (({}, 401), (KA, 401), (METRICS, 200), (ADMIN, 200)):
        assert httpx.get(edges.base_url + "/metrics", headers=headers).status_code == status, headers
    assert "kvserve:num_requests_running" in httpx.get(edges.base_url + "/metrics", headers=METRICS).text


# --- 8: a default output cap, a log line when a request runs uncapped, Allow on 405 ----------------


def test_the_default_cap_bounds_a_request_without_max_tokens(edges):
    answer = post(edges, "/v1/chat/completions", {"messages": HI, "ignore_eos": True}).json()
    assert answer["usage"]["completion_tokens"] == CAP and answer["choices"][0]["finish_reason"] == "length"
    answer = post(edges, "/v1/completions", {"prompt": "Hi", "ignore_eos": True}).json()
    assert answer["usage"]["completion_tokens"] == CAP  # below OpenAI's 16 for completions
    answer = post(edges, "/v1/responses", {"input": "Hi", "ignore_eos": True}).json()
    assert answer["usage"]["output_tokens"] == CAP
    answer = post(edges, "/v1/chat/completions", {"messages": HI, "ignore_eos": True, "max_tokens": CAP + 3}).json()
    assert answer["usage"]["completion_tokens"] == CAP + 3  # a request's own max_tokens is its own
    assert "without max_tokens" not in edges.log()


def test_an_uncapped_request_is_logged(server):
    with httpx.stream("POST", server.api_url + "/chat/completions", timeout=120,
                      json={"messages": HI, "stream": True}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # it runs; leaving aborts it
    assert "a request without max_tokens may generate up to" in server.log()
    assert "--default-max-tokens" in server.log()


@pytest.mark.parametrize("path, allow", [("/v1/chat/completions", "POST"), ("/v1/models", "GET"), ("/health", "GET"),
                                         ("/v1/messages", "POST"), ("/v1/kv_cache", "GET"),
                                         ("/lab/static/lab.css", "GET, HEAD")])
def test_trace_is_a_405_with_an_allow_header(edges, path, allow):
    response = httpx.request("TRACE", edges.base_url + path, headers=KA)
    assert response.status_code == 405
    assert response.headers["allow"] == allow, response.headers
