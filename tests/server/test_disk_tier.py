"""The disk tier behind the server: a restart keeps each tenant's prefixes, and only theirs."""

from tests.server.inprocess import serve_in_process, with_tiny_tokenizer

KEYS = ["alice-key", "bob-key"]
PROMPT = "The capital of the tiny model is a string of characters long enough for two blocks."


def cached_tokens(client, key: str) -> int:
    response = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_restart_keeps_each_tenants_prefix_blocks_and_only_theirs(tiny_models, tmp_path):
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    disk = str(tmp_path / "tier")
    with serve_in_process(loaded, kv_disk_path=disk, api_keys=KEYS) as client:
        assert cached_tokens(client, "alice-key") == 0
    # The app's shutdown closed the engine: the tier's queued writes are on disk.
    with serve_in_process(loaded, kv_disk_path=disk, api_keys=KEYS, admin_key="admin-key") as client:
        assert cached_tokens(client, "bob-key") == 0
        hits = cached_tokens(client, "alice-key")
        assert hits >= 32 and hits % 16 == 0
        # The tier's traffic counts every tenant's: the admin's report has it (a tenant's does not).
        report = client.get("/v1/kv_cache", headers={"Authorization": "Bearer admin-key"}).json()
        assert report["integrity"] == "ok"
        assert report["tier"]["hit_tokens"] == hits and report["tier"]["enabled"] is True
        assert report["tier"]["files_rejected"] == 0


def test_stored_responses_survive_a_restart_with_the_disk_tier(tiny_models, tmp_path):
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    disk, store = str(tmp_path / "tier"), str(tmp_path / "responses")
    alice = {"Authorization": "Bearer alice-key"}
    first_body = {"model": "tiny", "input": PROMPT, "max_output_tokens": 4, "temperature": 0}
    with serve_in_process(loaded, kv_disk_path=disk, api_keys=KEYS, responses_store_path=store) as client:
        first = client.post("/v1/responses", headers=alice, json=first_body)
        assert first.status_code == 200, first.text
        first = first.json()
    files = list((tmp_path / "responses").glob("resp_*.json"))
    assert [f.stem for f in files] == [first["id"]]
    with serve_in_process(loaded, kv_disk_path=disk, api_keys=KEYS, responses_store_path=store) as client:
        assert client.get(f"/v1/responses/{first['id']}", headers=alice).json() == first
        assert client.get(f"/v1/responses/{first['id']}", headers={"Authorization": "Bearer bob-key"}).status_code == 404
        follow_up = client.post("/v1/responses", headers=alice, json={
            "model": "tiny", "input": "And then?", "max_output_tokens": 2, "temperature": 0,
            "previous_response_id": first["id"]})
        assert follow_up.status_code == 200, follow_up.text
        usage = follow_up.json()["usage"]
        # The first turn's prompt and answer came back from the disk tier, token for token.
        assert usage["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] // 16 * 16 > 0
        assert client.delete(f"/v1/responses/{first['id']}", headers=alice).status_code == 200
    assert not list((tmp_path / "responses").glob(f"{first['id']}.json"))
    assert len(list((tmp_path / "tier").glob("*/??/*.kvblock"))) > 0  # the tier kept its blocks


def test_stored_responses_stay_in_memory_without_a_store_path_even_with_the_disk_tier(tiny_models, tmp_path):
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    with serve_in_process(loaded, kv_disk_path=str(tmp_path / "tier"), api_keys=KEYS) as client:
        first = client.post("/v1/responses", headers={"Authorization": "Bearer alice-key"},
                            json={"model": "tiny", "input": PROMPT, "max_output_tokens": 2, "temperature": 0})
        assert first.status_code == 200, first.text
    assert not list(tmp_path.rglob("resp_*.json"))
