"""The lab's kept-tokens endpoint: off until the page first asks, then each compressed chunk's kept positions per
layer and KV head, as the engine recorded them, decoded here from the bitmasks the page draws."""

import base64
from dataclasses import replace

import numpy as np
import pytest

import kvserve.kv.compression.engine_spec as engine_spec
from kvserve.kv.compression.spec import parse_compression
from tests.server.inprocess import assert_idle_and_intact, serve_in_process, with_tiny_tokenizer

PROMPT = [(7 * i) % 150 + 3 for i in range(60)]
CHUNK = 16


@pytest.fixture
def client(tiny_models, monkeypatch):
    # The tiny model's context is 256 tokens: 16-token chunks (blocks of 4) instead of the flag's 512.
    monkeypatch.setattr(engine_spec, "parse_compression",
                        lambda text: replace(parse_compression(text), chunk=CHUNK, window=4))
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    with serve_in_process(loaded, engine_options=dict(speculative="off", block_size=4)) as client:
        yield client


def complete(client, prompt, **extra):
    body = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0, kv_compression="streaming:2") | extra
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["id"] + "-0"  # the engine's id of the completion's only choice


def decode(chunk: dict, layers: int, heads: int) -> np.ndarray:
    """The page's bitmask -> kept positions [layers, heads, budget] within the chunk."""
    bits = np.frombuffer(base64.b64decode(chunk["kept"]), dtype=np.uint8).reshape(layers, heads, -1)
    mask = np.unpackbits(bits, axis=-1, bitorder="little")[..., : chunk["chunk"]].astype(bool)
    return np.stack([np.flatnonzero(row) for row in mask.reshape(-1, chunk["chunk"])]).reshape(layers, heads, -1)


def test_nothing_recorded_before_the_page_asks_then_each_chunk_per_layer_and_head(client, tiny_models):
    before = complete(client, PROMPT)
    listed = client.get("/lab/api/kept").json()  # the first ask starts the recording
    assert listed["requests"] == []
    assert client.get(f"/lab/api/kept/{before}").status_code == 404
    seen_ids = [complete(client, PROMPT[:56] + [5, 6, 7, 8]), complete(client, [9] + PROMPT[1:])]
    listed = client.get("/lab/api/kept").json()["requests"]
    assert [r["id"] for r in listed] == seen_ids[::-1]  # finished, newest first
    # The first shares chunks 0..2 with `before`, which left them compressed in the prefix cache: it compacted
    # none of them itself. The second differs at token 0: it compacted all three.
    hit, cold = listed[1], listed[0]
    assert hit["recorded"] == [] and hit["cached"] == [0, 1, 2]
    assert cold["recorded"] == [0, 1, 2] and cold["cached"] == [] and cold["finished"]
    body = client.get(f"/lab/api/kept/{cold['id']}").json()
    config = tiny_models("llama-gqa").config
    assert (body["layers"], body["kv_heads"]) == (config.num_layers, config.num_kv_heads)
    for chunk in body["chunks"]:
        kept = decode(chunk, body["layers"], body["kv_heads"])
        assert chunk["first_position"] == chunk["index"] * CHUNK and chunk["budget"] == CHUNK // 2
        recent = list(range(CHUNK // 2, CHUNK))  # StreamingLLM: each chunk's most recent half ...
        expected = [0, 1, 2, 3, *recent[4:]] if chunk["index"] == 0 else recent  # ... chunk 0 with its 4 sinks
        assert (kept == np.array(expected)).all()
    assert_idle_and_intact(client)
