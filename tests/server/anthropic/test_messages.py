"""/v1/messages through the official `anthropic` client, in process on the tiny model: cache_control
breakpoints that really write and read the cache, pins with a TTL (fake clock), pins under pressure."""

import anthropic
import pytest

from tests.server.inprocess import serve_in_process, with_tiny_tokenizer

KEYS = ["alice-key", "bob-key"]
# 67 tokens with its `<|im_start|>system\n` (character tokenizer): the breakpoint falls 3 tokens into the
# fifth block, so the question (8 markup tokens later) starts in the same block. Cache hits are whole
# blocks: a breakpoint whose block held only the system's end and markup would be read with that block too.
SYSTEM = "You answer questions about caching, briefly and exactly.!!!!"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock():
    return FakeClock()


@pytest.fixture(scope="module")
def app(tiny_models, clock):
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")), api_keys=KEYS, admin_key="admin-key",
                          clock=clock) as client:
        yield client


def client_for(app, key="alice-key"):
    return anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=app, max_retries=0)


def kv_report(app):
    """The whole pool's report (every tenant's pins): the admin's view (a tenant sees only its own)."""
    return app.get("/v1/kv_cache", headers={"Authorization": "Bearer admin-key"}).json()


def ask(client, question, ttl="5m", **kwargs):
    return client.messages.create(
        model="tiny", max_tokens=4, extra_body={"temperature": 0}, **kwargs,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": ttl}}],
        messages=[{"role": "user", "content": question}])


def test_a_breakpoint_writes_the_cache_then_the_next_call_reads_exactly_that(app):
    client = client_for(app)
    first = ask(client, "What is a block?")
    assert first.usage.cache_creation_input_tokens > 0 and first.usage.cache_read_input_tokens == 0
    second = ask(client, "Explain pinning.")
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    assert first.content[0].type == "text" and first.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    # Bearer and x-api-key are the same tenant: its cached prefix serves a Bearer caller too.
    bearer = app.post("/v1/messages", headers={"Authorization": "Bearer alice-key"}, json={
        "model": "tiny", "max_tokens": 2, "system": SYSTEM, "messages": [{"role": "user", "content": "Zed?"}]})
    assert bearer.status_code == 200 and bearer.json()["usage"]["cache_read_input_tokens"] > 0
    # Another tenant shares nothing.
    other = ask(client_for(app, "bob-key"), "What is a block?")
    assert other.usage.cache_read_input_tokens == 0 and other.usage.cache_creation_input_tokens > 0
    report = kv_report(app)
    assert report["pins"]["num_pins"] >= 2 and report["integrity"] == "ok"


def test_streaming_uses_anthropic_events_and_reports_the_same_usage(app):
    client = client_for(app)
    ask(client, "Warm?")
    events = list(ask(client, "Stream?", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[0].message.usage, events[-2].usage
    assert start.cache_read_input_tokens == delta.cache_read_input_tokens > 0
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == client.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0}, system=SYSTEM,
                                          messages=[{"role": "user", "content": "Stream?"}]).content[0].text


def test_pins_expire_after_their_ttl_and_a_hit_refreshes_them(app, clock):
    client = client_for(app, "bob-key")
    clock.now += 3600 * 2  # every pin of the earlier tests expires
    assert kv_report(app)["pins"]["num_pins"] == 0
    ask(client, "One?", ttl="5m")
    pinned = kv_report(app)["pins"]
    assert pinned["num_pins"] == 1 and pinned["num_pinned_blocks"] > 0
    clock.now += 200
    ask(client, "Two?", ttl="5m")  # a hit on the pinned prefix: renewed for another 5 minutes
    clock.now += 200
    assert kv_report(app)["pins"]["num_pins"] == pinned["num_pins"]
    clock.now += 301
    report = kv_report(app)
    assert report["pins"]["num_pins"] == 0 and report["pins"]["num_pinned_blocks"] == 0
    assert report["pins"]["pins_expired"] >= pinned["num_pins"] and report["integrity"] == "ok"
    metrics = app.get("/metrics").text
    assert "kvserve:kv_pinned_blocks{" in metrics and "kvserve:cache_write_tokens_total{" in metrics


@pytest.mark.parametrize("body, named", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {"type": "object"}}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"system": [{"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]},
     "breakpoints"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "ttl"),
])
def test_unsupported_or_invalid_requests_get_400_naming_them(app, body, named):
    request = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    response = app.post("/v1/messages", headers={"x-api-key": "alice-key"}, json=request)
    assert response.status_code == 400 and named in response.text, response.text


def test_pins_lapse_rather_than_stop_a_request_that_needs_the_pool(tiny_models):
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")), kv_cache_memory="192KiB",  # 16 blocks of 16 tokens: the context
                          engine_options={"max_pinned_fraction": 1.0}) as app:
        num_blocks = app.get("/v1/kv_cache").json()["num_blocks"]
        client = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=app, max_retries=0)
        for i in range(3):  # three pinned prefixes of 4 blocks each (66 tokens up to the breakpoint)
            client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": f"{i}" * 60, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
        before = app.get("/v1/kv_cache").json()
        assert before["pins"]["num_pins"] == 3 and before["pins"]["num_pinned_blocks"] == 12
        # A request that needs every block of the pool still runs: pinned blocks are evicted, their pins lapse.
        big = client.messages.create(model="tiny", max_tokens=num_blocks * 16 - 40, messages=[
            {"role": "user", "content": "z" * 20}], extra_body={"ignore_eos": True})
        assert big.usage.output_tokens == num_blocks * 16 - 40
        after = app.get("/v1/kv_cache").json()
        assert after["pins"]["pins_lapsed"] == 3 and after["pins"]["num_pinned_blocks"] == 0
        assert after["integrity"] == "ok" and after["num_used_blocks"] == 0
