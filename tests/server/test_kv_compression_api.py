"""KV compression through the API: the request's kv_compression field, the usage detail, /v1/kv_cache."""

from dataclasses import replace

import kvserve.kv.compression.engine_spec as engine_spec
from kvserve.kv.compression.spec import parse_compression
from tests.server.inprocess import assert_idle_and_intact, serve_in_process, with_tiny_tokenizer

PROMPT = [(7 * i) % 150 + 3 for i in range(60)]


def test_a_request_compresses_and_usage_says_how_many_tokens_it_dropped(tiny_models, monkeypatch):
    # The tiny model's context is 256 tokens: 16-token chunks (blocks of 4) instead of the flag's 512.
    monkeypatch.setattr(engine_spec, "parse_compression",
                        lambda text: replace(parse_compression(text), chunk=16, window=4))
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    with serve_in_process(loaded, engine_options=dict(speculative="off", block_size=4)) as client:
        body = dict(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        plain = client.post("/v1/completions", json=body).json()
        assert "kvserve_dropped_tokens" not in plain["usage"]["prompt_tokens_details"]
        compressed = client.post("/v1/completions", json=body | dict(kv_compression="knorm:2")).json()
        # Chunks 0..2 are followed by >= 4 prompt tokens: each keeps 8 of its 16.
        assert compressed["usage"]["prompt_tokens_details"]["kvserve_dropped_tokens"] == 24
        assert client.get("/v1/kv_cache").json()["num_compressed_tokens"] == 24
        refused = client.post("/v1/completions", json=body | dict(kv_compression="expected_attention:2"))
        assert refused.status_code == 400 and "queries" in refused.text
        off = client.post("/v1/completions", json=body | dict(kv_compression="none")).json()
        assert "kvserve_dropped_tokens" not in off["usage"]["prompt_tokens_details"]
        assert_idle_and_intact(client)
