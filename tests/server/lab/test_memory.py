"""The calculator's endpoint gives `kvserve memory --json`'s figures, from the same planner."""

import contextlib
import io
import json

import pytest

from kvserve.cli import main
from kvserve.model.catalog import num_parameters
from kvserve.planner import plan

CASES = [
    ({"model": "Llama-3.1-8B", "context": 131072, "batch": 1, "kv_dtype": "float16"},
     ["Llama-3.1-8B", "--context", "131072", "--batch", "1", "--kv-dtype", "float16"]),
    ({"model": "Llama-3.1-70B", "context": 8192, "batch": 16, "kv_dtype": "int8", "memory": "160GiB"},
     ["Llama-3.1-70B", "--context", "8192", "--batch", "16", "--kv-dtype", "int8", "--memory", "160GiB"]),
    ({"model": "Qwen2.5-0.5B", "context": 30000, "batch": 7, "kv_dtype": "int4", "weights_dtype": "q4_k",
      "memory": "8GiB", "block_size": 32, "overhead": 0.25},
     ["Qwen2.5-0.5B", "--context", "30000", "--batch", "7", "--kv-dtype", "int4", "--weights-dtype", "q4_k",
      "--memory", "8GiB", "--block-size", "32", "--overhead", "0.25"]),
    ({"model": "custom", "layers": 24, "kv_heads": 2, "head_dim": 64, "heads": 14, "params": 5e8, "context": 4096,
      "batch": 3, "kv_dtype": "int8/int4", "memory": "4GiB"},
     ["--layers", "24", "--kv-heads", "2", "--head-dim", "64", "--heads", "14", "--params", "5e8", "--context",
      "4096", "--batch", "3", "--kv-dtype", "int8/int4", "--memory", "4GiB"]),
    # A hybrid model: K/V per token for 6 attention layers, a 20,201,472-byte state per request for 18 others.
    ({"model": "Qwen3.5-0.8B", "context": 65536, "batch": 4, "memory": "16GiB"},
     ["Qwen3.5-0.8B", "--context", "65536", "--batch", "4", "--memory", "16GiB"]),
]


def cli_json(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *args, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("query, args", CASES)
def test_endpoint_equals_the_cli(lab_app, query, args):
    body = lab_app.get("/lab/api/memory", params=query).json()
    assert body["plan"] == cli_json(args)


def test_the_issue_link_shows_16_gib_of_kv(lab_app):
    body = lab_app.get("/lab/api/memory?model=Llama-3.1-8B&context=131072&batch=1&kv_dtype=float16").json()
    assert body["display"]["kv_bytes_total"] == "16.00 GiB" and body["plan"]["kv_bytes_total"] == 2**34


def test_catalog_lists_the_presets(lab_app):
    catalog = lab_app.get("/lab/api/models").json()
    assert catalog["served"] == "tiny" and catalog["models"][0]["name"] == "tiny"  # the served model first
    llama = next(m for m in catalog["models"] if m["name"] == "Llama-3.1-8B")
    assert (llama["layers"], llama["kv_heads"], llama["head_dim"], llama["context"]) == (32, 8, 128, 131072)
    assert "int8" in catalog["kv_dtypes"] and "q4_k" in catalog["weights_dtypes"]


@pytest.mark.parametrize("query, message", [
    ({"model": "/etc/passwd"}, "unknown model"),  # never a path: a browser must not make the server read files
    ({"model": "Llama-3.1-8B", "kv_dtype": "int3"}, "int3"),
    ({"model": "Llama-3.1-8B", "weights_dtype": "fp2"}, "fp2"),
    ({"model": "Llama-3.1-8B", "memory": "lots"}, "lots"),
    ({"model": "custom", "layers": 4}, "--layers"),
    ({"model": "custom", "layers": 4, "kv_heads": 3, "head_dim": 64, "heads": 8, "context": 10}, "multiple"),
    ({"model": "Llama-3.1-8B", "context": 0}, "context"),
])
def test_bad_inputs_get_400_with_the_reason(lab_app, query, message):
    response = lab_app.get("/lab/api/memory", params=query)
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_the_served_model_is_the_default_and_its_own_shape(lab_app, tiny_models):
    """No model asked: the served one, planned from the shape the server loaded, under the name it reports."""
    config = tiny_models("llama-gqa").config
    body = lab_app.get("/lab/api/memory", params={"batch": 2, "memory": "1GiB"}).json()
    expected = plan("tiny", config, num_parameters(config), config.max_position_embeddings, 2, "float16", 16,
                    "float16", 2**30, 0.1)
    assert body["plan"] == expected.to_json()
    assert lab_app.get("/lab/api/memory", params={"model": "tiny", "batch": 2, "memory": "1GiB"}).json() == body
