"""KV compression in the lab, in a real headless Chromium against `kvserve serve --kv-compression knorm:2`
(embedded model): the calculator's compressed figures are the CLI's, and the kept-tokens page draws what the
engine recorded, layer by layer and head by head."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.lab.browser import requires_chromium
from tests.server.lab.test_browser import wait_shown
from tests.server.lab.test_memory import cli_json

pytestmark = [pytest.mark.browser, requires_chromium]
BROWSER_HEIGHT = 1400


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("kept-lab"), "--kv-compression", "knorm:2")
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log()


def test_calculator_compressed_figures_are_the_clis(lab_server, browser):
    browser.goto(f"{lab_server.base_url}/lab/memory?model=Llama-3.1-8B&context=32768&batch=4&memory=80GiB")
    wait_shown(browser, model="Llama-3.1-8B")
    browser.set_input("kv_compression", "knorm:4")
    browser.set_input("max_tokens", 1000)
    wait_shown(browser, kv_compression="knorm:4", max_tokens="1000")
    plan = cli_json(["Llama-3.1-8B", "--context", "32768", "--batch", "4", "--memory", "80GiB", "--kv-compression",
                     "knorm:4", "--max-tokens", "1000"])

    def number(element_id: str) -> int:
        return int(browser.text(element_id).split()[0].replace(",", ""))

    assert number("compressed-per-request-bytes") == plan["kv_bytes_per_request_compressed"]
    assert number("compressed-max-requests") == plan["max_concurrent_requests_compressed"]
    assert number("compressed-max-context") == plan["max_context_compressed"]
    assert number("compressed-dropped") == plan["dropped_tokens_per_request"]
    assert browser.evaluate("getComputedStyle(document.getElementById('compressed')).display") != "none"
    browser.set_input("kv_compression", "none")
    wait_shown(browser, kv_compression="none")
    assert browser.evaluate("getComputedStyle(document.getElementById('compressed')).display") == "none"


def test_kept_page_draws_what_the_engine_kept(lab_server, browser, shots):
    browser.goto(f"{lab_server.base_url}/lab/kept")  # opening the page starts the recording
    browser.wait_for("document.body.dataset.listed !== undefined")
    prompt = np.random.default_rng(0).integers(1000, 40000, 700).tolist()  # chunk 0 compressed (512 + 64 <= 700)
    response = httpx.post(lab_server.api_url + "/completions", timeout=300,
                          json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens_details"]["kvserve_dropped_tokens"] == 256
    request_id = response.json()["id"] + "-0"
    browser.evaluate("document.getElementById('kept-refresh').click()")
    assert browser.wait_for(f"document.body.dataset.ready === {request_id!r} && document.body.dataset.ready")
    record = httpx.get(f"{lab_server.base_url}/lab/api/kept/{request_id}", timeout=30).json()
    layers, heads, chunk = record["layers"], record["kv_heads"], record["chunks"][0]
    bits = np.frombuffer(base64.b64decode(chunk["kept"]), dtype=np.uint8).reshape(layers, heads, -1)
    mask = np.unpackbits(bits, axis=-1, bitorder="little").astype(bool)
    assert chunk["budget"] == 256 and (mask.sum(-1) == 256).all() and mask[:, :, :4].all()  # the budget, sinks
    page = np.array(browser.evaluate(
        f"[...Array({layers})].map((_, l) => [...Array({heads})].map((_, h) => "
        f"[...Array({chunk['chunk']})].map((_, p) => keptAt(l, h, p))))"))
    assert (page == mask).all()
    assert mask.any(axis=(0, 1)).sum() > 256  # layers and heads keep different tokens
    browser.screenshot(shots / "lab-kept.png")
