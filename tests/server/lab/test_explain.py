"""The explainer: recent requests' prefix-cache reports and pasted prompts looked up without running."""

PREFIX = "The capital is where the capital is, and the capital is "


def test_pasted_prompt_shows_hit_and_divergence_but_not_others_text(lab_app):
    assert lab_app.post("/v1/completions", json={"prompt": PREFIX + "here.", "max_tokens": 2}).status_code == 200
    before = lab_app.get("/v1/kv_cache").json()
    body = lab_app.post("/lab/api/explain", json={"prompt": PREFIX + "there."}).json()
    assert body["num_cached_tokens"] > 0 and body["divergence_position"] >= body["num_cached_tokens"]
    assert body["prompt"]["cached"] + body["prompt"]["matched"] + body["prompt"]["rest"] == PREFIX + "there."
    assert body["divergence"]["prompt"].startswith("t") and body["divergence"]["cached"] is None
    assert not body["cached_text_shown"]
    after = lab_app.get("/v1/kv_cache").json()
    assert after["prefix_cache_queries"] == before["prefix_cache_queries"]  # a lookup, not a request


def test_recent_requests_are_listed_without_prompt_text(lab_app):
    response = lab_app.post("/v1/completions", json={"prompt": PREFIX + "again.", "max_tokens": 2}).json()
    recent = lab_app.get("/lab/api/recent").json()
    newest = recent["requests"][0]
    assert newest["id"] == response["id"] + "-0" and newest["cached_tokens"] == response["usage"][
        "prompt_tokens_details"]["cached_tokens"] > 0
    body = lab_app.post("/lab/api/explain", json={"request_id": newest["id"]}).json()
    assert body["num_cached_tokens"] == newest["cached_tokens"] and "prompt" not in body
    assert lab_app.post("/lab/api/explain", json={"request_id": "nope"}).status_code == 404


def test_with_log_prompts_both_sides_are_shown(logging_lab_app):
    client = logging_lab_app
    assert client.post("/v1/completions", json={"prompt": PREFIX + "here.", "max_tokens": 2}).status_code == 200
    second = client.post("/v1/completions", json={"prompt": PREFIX + "there.", "max_tokens": 2}).json()
    body = client.post("/lab/api/explain", json={"request_id": second["id"] + "-0"}).json()
    assert body["cached_text_shown"] and body["divergence"]["prompt"].startswith("t")
    assert body["divergence"]["cached"].startswith("h")
    assert "".join(body["prompt"].values()) == PREFIX + "there."


def test_yellow_is_only_text_that_matched_a_cached_block(lab_app):
    """Where no cached prompt goes on past the cached prefix (or nothing is cached at all), nothing is
    "matched": the text after the cache's cut is new, not yellow."""
    fresh = "Zebras quietly juggle seventeen violet umbrellas beneath an unusual moon tonight."
    body = lab_app.post("/lab/api/explain", json={"prompt": fresh}).json()
    assert body["num_cached_tokens"] == 0 and body["divergence_position"] in (None, 0)
    assert body["prompt"] == {"cached": "", "matched": "", "rest": fresh}

    assert lab_app.post("/v1/completions", json={"prompt": PREFIX + "here.", "max_tokens": 1}).status_code == 200
    longer = PREFIX + "here. " + fresh
    body = lab_app.post("/lab/api/explain", json={"prompt": longer}).json()
    assert body["num_cached_tokens"] > 0 and body["divergence_position"] is None, body["reason"]
    assert body["prompt"]["matched"] == "" and body["prompt"]["cached"] + body["prompt"]["rest"] == longer
