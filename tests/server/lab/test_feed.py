"""The snapshot and feed endpoints: what the cache map draws, from the engine's stats snapshot."""

import json

from tests.server.inprocess import assert_idle_and_intact

PREFIX = "The capital is where the capital is, and the capital is "  # a few full 16-token blocks


def test_snapshot_blocks_agree_with_kv_cache(lab_app):
    for suffix in ("here", "there", "everywhere"):
        assert lab_app.post("/v1/completions", json={"prompt": PREFIX + suffix, "max_tokens": 4}).status_code == 200
    snapshot = lab_app.get("/lab/api/snapshot").json()
    report = lab_app.get("/v1/kv_cache").json()
    view = snapshot["blocks"]
    assert view["step"] == snapshot["step"] == report["num_steps"]
    assert len(view["ref"]) == len(view["hashed"]) == report["num_blocks"]
    counts = view["counts"]
    assert counts["used"] + counts["shared"] == report["num_used_blocks"] == 0
    assert counts["free"] + counts["cached"] == report["num_free_blocks"]
    assert counts["cached"] == report["num_cached_free_blocks"] == view["hashed"].count("1") > 0
    assert snapshot["counters"]["prefix_cache_hits"] == report["prefix_cache_hits"] > 0
    assert_idle_and_intact(lab_app)


def test_feed_sends_snapshots_and_the_block_view_only_when_it_changed(lab_app):
    events = []
    with lab_app.stream("GET", "/lab/api/feed") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
    first, second, third = events
    assert first["blocks"] is not None and first["blocks"]["step"] == first["step"]  # idle: built at once
    assert second["blocks"] is None and third["blocks"] is None  # idle: nothing new to send
    assert first["pool"]["num_blocks"] == len(first["blocks"]["ref"]) and first["running"] == []


def test_feed_ends_when_the_server_starts_shutting_down(tiny_models):
    from tests.server.inprocess import serve_in_process, with_tiny_tokenizer

    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa"))) as client:
        client.app.state.async_engine.draining = True  # what the first SIGTERM does (AsyncEngine.drain)
        with client.stream("GET", "/lab/api/feed") as response:
            assert response.status_code == 200 and list(response.iter_lines()) == []  # ends by itself
