"""Fairness at the API: each API key's share of the waiting queue (the flooding key gets 429 with Retry-After,
the others do not), `priority` and `service_tier` accepted, and per-tenant usage shown to the admin and to
each tenant only its own. In process, on the tiny random model."""

import pytest

from kvserve.errors import ConfigError
from kvserve.server.core.priority import request_priority
from kvserve.server.core.tenancy import Tenancy, tenant_id
from tests.server.inprocess import assert_idle_and_intact, serve_in_process, with_tiny_tokenizer

KEYS = ["alice-key", "bob-key"]


@pytest.fixture(scope="module")
def app(tiny_models):
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")), api_keys=KEYS, admin_key="admin-key",
                          max_waiting_requests=8, tenant_weights=[1.0, 3.0]) as client:
        yield client


def complete(client, key, **extra):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": "The capital is", "max_tokens": 2, "temperature": 0, **extra})


def test_a_key_past_its_share_of_the_queue_gets_429_and_the_others_do_not(app):
    unstarted = app.app.state.async_engine.num_unstarted_by_tenant
    alice = tenant_id("alice-key")
    assert app.app.state.async_engine.num_unstarted_by_tenant[alice] == 0
    unstarted[alice] = 2  # as if alice had her whole share (8 x 1/4) waiting
    try:
        refused = complete(app, "alice-key")
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1" and "share of the server's queue is 2" in refused.text
        assert complete(app, "bob-key").status_code == 200  # bob's share (6) is untouched
    finally:
        del unstarted[alice]
    assert complete(app, "alice-key").status_code == 200
    assert not app.app.state.async_engine.num_unstarted_by_tenant  # every request counted out again
    assert_idle_and_intact_with_key(app)


def assert_idle_and_intact_with_key(client):
    report = client.get("/v1/kv_cache", headers={"Authorization": "Bearer admin-key"}).json()
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok", report


def test_priority_and_service_tier_are_accepted_and_checked(app):
    assert complete(app, "alice-key", priority=-5).status_code == 200
    assert complete(app, "alice-key", service_tier="flex").status_code == 200
    chat = app.post("/v1/chat/completions", headers={"Authorization": "Bearer bob-key"},
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "service_tier": "priority",
                          "priority": 3})
    assert chat.status_code == 200, chat.text
    bad = complete(app, "alice-key", priority=2**40)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert complete(app, "alice-key", service_tier="platinum").status_code == 400
    assert request_priority(None, "priority") == -1 and request_priority(None, "flex") == 1
    assert request_priority(7, "priority") == 7 and request_priority(None, None) == 0


def test_each_tenant_sees_only_its_own_usage_and_the_admin_sees_all(app):
    complete(app, "alice-key")
    complete(app, "bob-key")
    admin = app.get("/v1/kv_cache", headers={"Authorization": "Bearer admin-key"}).json()
    tenants = {entry["tenant"]: entry for entry in admin["tenants"]}
    assert {tenant_id("alice-key"), tenant_id("bob-key")} <= set(tenants)
    assert tenants[tenant_id("bob-key")]["weight"] == 3.0 and tenants[tenant_id("alice-key")]["weight"] == 1.0
    assert all(entry["num_scheduled_tokens"] > 0 for entry in tenants.values())
    own = app.get("/v1/kv_cache", headers={"Authorization": "Bearer alice-key"}).json()
    assert [entry["tenant"] for entry in own["tenants"]] == [tenant_id("alice-key")]
    metrics = app.get("/metrics").text
    assert 'kvserve:tenant_scheduled_tokens_total{model_name="tiny",tenant="1"}' in metrics
    assert 'tenant="2"' in metrics and "alice-key" not in metrics and tenant_id("alice-key") not in metrics


def test_weights_follow_key_order_and_are_checked():
    tenancy = Tenancy(KEYS)
    assert tenancy.weights([2.0]) == {tenant_id("alice-key"): 2.0, tenant_id("bob-key"): 1.0}
    with pytest.raises(ConfigError):
        tenancy.weights([1.0, 1.0, 1.0])
    with pytest.raises(ConfigError):
        tenancy.weights([0.0])


def test_without_keys_there_is_one_anonymous_tenant(tiny_models):
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa"))) as client:
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        report = client.get("/v1/kv_cache").json()
        assert [entry["tenant"] for entry in report["tenants"]] == [None]
        assert "kvserve:tenant_" not in client.get("/metrics").text
        assert_idle_and_intact(client)
