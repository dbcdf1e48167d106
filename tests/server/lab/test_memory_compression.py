"""The calculator with KV compression: `kvserve memory --kv-compression ... --json`'s figures, from the same planner."""

import pytest

from tests.server.lab.test_memory import cli_json

CASES = [
    ({"model": "SmolLM2-135M", "context": 4096, "batch": 2, "memory": "500MiB", "kv_compression": "knorm:2"},
     ["SmolLM2-135M", "--context", "4096", "--batch", "2", "--memory", "500MiB", "--kv-compression", "knorm:2"]),
    ({"model": "Llama-3.1-8B", "context": 32768, "batch": 8, "memory": "80GiB", "kv_compression": "auto:4",
      "max_tokens": 1024, "kv_dtype": "int8"},
     ["Llama-3.1-8B", "--context", "32768", "--batch", "8", "--memory", "80GiB", "--kv-compression", "auto:4",
      "--max-tokens", "1024", "--kv-dtype", "int8"]),
    ({"model": "Llama-3.1-8B", "context": 8192, "kv_compression": "none", "max_tokens": 0},
     ["Llama-3.1-8B", "--context", "8192"]),
]


@pytest.mark.parametrize("query, args", CASES)
def test_endpoint_equals_the_cli(lab_app, query, args):
    body = lab_app.get("/lab/api/memory", params=query).json()
    assert body["plan"] == cli_json(args)
    if body["plan"]["kv_compression"]:
        assert body["display"]["kv_bytes_per_request_compressed"].endswith("iB")


def test_the_catalog_offers_compressions_and_refusals_are_400s(lab_app):
    assert "knorm:2" in lab_app.get("/lab/api/models").json()["kv_compressions"]
    refused = lab_app.get("/lab/api/memory", params={"model": "Llama-3.1-8B", "context": 4096, "kv_dtype": "int4",
                                                      "kv_compression": "knorm:2"})
    assert refused.status_code == 400 and "encodes whole blocks" in refused.text
    bad = lab_app.get("/lab/api/memory", params={"model": "Llama-3.1-8B", "kv_compression": "expected_attention:2"})
    assert bad.status_code == 400 and "queries" in bad.text
