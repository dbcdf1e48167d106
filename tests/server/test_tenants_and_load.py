"""API keys and tenant isolation of the prefix cache, the bounded queue, and disconnects under load."""

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = ("You are a meticulous assistant. Here is a long shared preamble about caching, with enough words to "
          "span several sixteen-token blocks of the KV cache so that reuse is visible in the usage report. ")


def completion(server, key, prompt=PROMPT, **extra):
    response = httpx.post(server.api_url + "/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"} if key else {},
                          json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    return response


def cached_tokens(response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_missing_or_wrong_key_is_401(tenant_server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "alice-key"}):
        response = httpx.get(tenant_server.api_url + "/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=tenant_server.api_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert httpx.get(tenant_server.base_url + "/health").status_code == 200  # open, like /metrics


def test_tenants_never_share_cached_blocks(tenant_server):
    assert cached_tokens(completion(tenant_server, "alice-key")) == 0
    alice_again = cached_tokens(completion(tenant_server, "alice-key"))
    assert alice_again > 0
    assert cached_tokens(completion(tenant_server, "bob-key")) == 0  # same prompt, other tenant
    assert cached_tokens(completion(tenant_server, "bob-key")) == alice_again  # bob's own copy now


def test_client_salt_narrows_but_never_widens(tenant_server):
    prompt = "Salted variant. " + PROMPT  # shares no leading block with the other tests
    assert cached_tokens(completion(tenant_server, "alice-key", prompt)) == 0
    # A salt splits alice's own traffic ...
    assert cached_tokens(completion(tenant_server, "alice-key", prompt, cache_salt="team-a")) == 0
    assert cached_tokens(completion(tenant_server, "alice-key", prompt, cache_salt="team-a")) > 0
    # ... and bob cannot reach alice's blocks whatever salt he sends.
    for salt in (None, "team-a", "alice-key"):  # each is bob's first request under that salt
        extra = {"cache_salt": salt} if salt else {}
        assert cached_tokens(completion(tenant_server, "bob-key", prompt, **extra)) == 0
    assert cached_tokens(completion(tenant_server, "bob-key", prompt, cache_salt="team-a")) > 0  # his own, from above


def test_overload_is_refused_with_429_at_once(tenant_server):
    """One batch slot and two waiting places, one per key: of eight simultaneous requests some must be refused."""

    async def burst():
        async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer alice-key"}) as http:
            body = {"prompt": "Count slowly:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(http.post(tenant_server.api_url + "/completions", json=body)
                                          for _ in range(8)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    # All eight arrive before a step runs, so they all wait: alice's share is one place, one accepted (at least).
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    assert set(statuses) <= {200, 429}
    assert all(r.headers["Retry-After"] == "1" for r in responses if r.status_code == 429)
    report = tenant_server.wait_idle()
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok"


def test_more_choices_than_the_queue_holds_is_400_not_429(tenant_server):
    """Two waiting places: n=3 can never be queued, so retrying would never help."""
    response = completion(tenant_server, "alice-key", "Hi", n=3)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "queues at most 2" in error["message"], error


def test_sixty_four_streaming_clients_with_a_quarter_disconnecting(server):
    """Every stream that stays completes; the ones that leave are aborted and free their blocks."""
    aborted_before = _metric_or_zero(server, "kvserve:request_success_total", finished_reason="abort")

    async def client(i: int, http: httpx.AsyncClient):
        leaves = i % 4 == 0
        body = {"model": "SmolLM2-135M-Instruct", "stream": True, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Client {i}: tell me a long story about the number {i}."}],
                # Leavers ask for far more than the test waits for: only an abort ends them early.
                "max_tokens": 2000 if leaves else 16}
        chunks, finish = 0, None
        async with http.stream("POST", server.api_url + "/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                chunks += 1
                finish = choice["finish_reason"] or finish
                if leaves and chunks >= 3:
                    return "left"  # closes the connection mid-stream
        return finish

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(client(i, http) for i in range(64)))

    results = asyncio.run(run())
    assert results.count("left") == 16
    assert [r for r in results if r != "left"] == ["length"] * 48
    assert httpx.get(server.base_url + "/health").status_code == 200
    report = server.wait_idle(timeout=60)
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok"
    assert server.metric("kvserve:kv_cache_blocks_used") == 0
    assert server.metric("kvserve:request_success_total", finished_reason="abort") - aborted_before == 16


def _metric_or_zero(server, name, **labels):
    try:
        return server.metric(name, **labels)
    except AssertionError:
        return 0.0
