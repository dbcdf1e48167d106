"""The lab on a model whose layers differ in what they keep (a tiny Gemma 4, in process): /lab/api/info says which
layers store K/V, in what shape and pool slots, and which read an earlier layer's cache; the cache page draws
them as a strip (in headless Chromium). A model whose every layer stores alike has neither."""

from __future__ import annotations

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from tests.server.inprocess import serve_in_process, with_tiny_tokenizer
from tests.server.lab.browser import requires_chromium, serve_on_port


@pytest.fixture(scope="module")
def gemma4_loaded(tiny_models):
    return with_tiny_tokenizer(tiny_models("gemma4"))


def test_info_lists_what_each_layer_keeps(gemma4_loaded, lab_app):
    with serve_in_process(gemma4_loaded, engine_options={"weights_dtype": "float32"}) as client:
        kv = client.get("/lab/api/info").json()["kv_layers"]
        body = {"prompt": "The capital is where the capital is, and the capital is", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
    layers = kv["layers"]
    assert [layer.get("reads") for layer in layers] == [None, None, None, None, 3, 2]
    sliding, full = layers[0], layers[2]
    assert (sliding["window"], sliding["kv_heads"], sliding["head_dim"], sliding["k_eq_v"]) == (8, 2, 16, False)
    assert (full["window"], full["kv_heads"], full["head_dim"], full["k_eq_v"], full["packed"]) == (None, 1, 32, True, True)
    assert (kv["slots"], kv["slot_rows"], kv["row_width"]) == (4, 2, 16) and [l["slots"] for l in layers[:4]] == [[0], [1], [2], [3]]
    assert kv["padding_bytes_per_token"] == 2 * 16 * 4  # float32: the K = V layer fills one row of two per side
    assert lab_app.get("/lab/api/info").json()["kv_layers"] is None  # every layer alike


@pytest.mark.browser
@requires_chromium
def test_the_cache_page_draws_the_layer_strip(gemma4_loaded, browser, shots):
    engine = Engine(EngineConfig(kv_cache_memory="4MiB", weights_dtype="float32"), loaded=gemma4_loaded)
    with serve_on_port(engine, "tiny-gemma4") as base_url:
        browser.goto(base_url + "/lab")
        browser.wait_for("Number(document.body.dataset.updates) >= 1")
        cells = browser.evaluate("[...document.querySelectorAll('#kv-layer-cells .kv-layer')]"
                                 ".map((c) => [c.textContent, c.className])")
        browser.screenshot(shots / "lab-gemma4-layers.png", full_page=False)
    assert browser.evaluate("document.getElementById('kv-layer-strip').style.display") == ""
    assert cells == [["0", "kv-layer kv-store"], ["1", "kv-layer kv-store"], ["2", "kv-layer kv-keqv"],
                     ["3", "kv-layer kv-store"], ["4→3", "kv-layer kv-read"], ["5→2", "kv-layer kv-read"]]
    assert browser.text("kv-layer-about").startswith("4 layers store K/V in 4 slots of 2 × 16, 2 read an earlier")


@pytest.mark.browser
@requires_chromium
def test_the_memory_page_shows_what_every_layer_storing_its_own_would_hold(lab_app, browser, tiny_models):
    engine = Engine(EngineConfig(kv_cache_memory="4MiB"), loaded=with_tiny_tokenizer(tiny_models("llama-gqa")))
    with serve_on_port(engine, "tiny") as base_url:
        browser.goto(base_url + "/lab/memory?model=Gemma-4-E2B&context=32768&kv_dtype=float16")
        browser.wait_for("document.body.dataset.ready && document.body.dataset.ready !== 'error'")
        shown = browser.evaluate("document.getElementById('kv-unshared').style.display")
        per_request, unshared = browser.text("kv-per-request"), browser.text("kv-unshared-size")
        browser.goto(base_url + "/lab/memory?model=Llama-3.1-8B&context=8192")
        browser.wait_for("document.body.dataset.ready && document.body.dataset.ready !== 'error'")
        hidden = browser.evaluate("document.getElementById('kv-unshared').style.display")
    assert (shown, per_request, unshared, hidden) == ("", "198.00 MiB", "462.00 MiB", "none")
