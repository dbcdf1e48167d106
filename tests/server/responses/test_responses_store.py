"""The stored-responses store written through to disk: bounds, restarts, bad files, tenants."""

import uuid

from kvserve.server.responses.store import ResponsesStore, StoredResponse


def entry(tenant="t1", tokens=(1, 2, 3)) -> StoredResponse:
    response_id = f"resp_{uuid.uuid4().hex}"
    return StoredResponse(response_id, tenant, {"id": response_id, "output": []}, ({"role": "user"},), None,
                          (7,), (tuple(tokens),))


def test_a_new_store_reads_back_what_an_earlier_one_kept_within_its_bounds(tmp_path):
    store = ResponsesStore(max_responses=2, directory=tmp_path)
    old, kept, newest = entry(), entry(), entry("t2")
    for item in (old, kept, newest):
        store.put(item)
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == sorted([kept.response_id, newest.response_id])
    again = ResponsesStore(max_responses=2, directory=tmp_path)
    assert again.get(kept.response_id, "t1") == kept
    assert again.get(newest.response_id, "t1") is None  # another tenant's
    assert again.get(old.response_id, "t1") is None
    assert again.delete(kept.response_id, "t1") and not (tmp_path / f"{kept.response_id}.json").exists()


def test_unreadable_files_are_removed_and_the_rest_load(tmp_path):
    good = entry()
    ResponsesStore(directory=tmp_path).put(good)
    (tmp_path / f"resp_{'0' * 32}.json").write_text("{not json")
    (tmp_path / f"resp_{'1' * 32}.json").write_text('{"version": 1, "response_id": "../../etc/passwd"}')
    store = ResponsesStore(directory=tmp_path)
    assert len(store) == 1 and store.get(good.response_id, "t1") == good
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == [good.response_id]


def test_an_unusable_directory_leaves_the_store_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = ResponsesStore(directory=blocker / "responses")
    item = entry()
    store.put(item)
    assert not store.persistent and store.get(item.response_id, "t1") == item
    assert "keeping them in memory only" in caplog.text


def test_replicas_sharing_a_directory_find_each_others_responses_for_the_same_tenant_only(tmp_path):
    one, other = ResponsesStore(directory=tmp_path), ResponsesStore(directory=tmp_path)  # two replicas, one host
    stored = entry()
    one.put(stored)
    assert other.get(stored.response_id, "t2") is None  # another tenant: not found, as on one server
    found = other.get(stored.response_id, "t1")
    assert found is not None and found.turns == stored.turns and len(other) == 1
    assert other.get("resp_" + "0" * 32, "t1") is None and other.get("../etc/passwd", "t1") is None
