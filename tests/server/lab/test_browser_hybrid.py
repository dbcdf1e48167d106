"""The lab's recurrent-state strip in a real headless Chromium, against the toy hybrid model served on
127.0.0.1 (in this process, by uvicorn on a thread: `kvserve serve` loads only real checkpoints): while
requests run the strip shows live slots, after them the snapshots they left; the memory calculator shows
both cache kinds. A model whose every layer attends shows no strip (tests/server/lab/test_browser.py's pages
are unchanged).

Screenshots go to pytest's temporary folder and, with KVSERVE_LAB_SCREENSHOTS=DIR, to DIR too.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from tests.server.inprocess import with_tiny_tokenizer
from tests.server.lab.browser import requires_chromium, serve_on_port
from tests.server.lab.test_hybrid_lab import KV_MEMORY, NUM_SLOTS, hybrid_options
from tests.toy_hybrid import toy_hybrid

pytestmark = [pytest.mark.browser, requires_chromium]
BROWSER_HEIGHT = 900

STATE_COUNTS = """(() => {
  const n = (id) => Number(document.getElementById(id).textContent.replace(/,/g, ''));
  return {shown: document.getElementById('state-strip').style.display !== 'none',
          height: document.getElementById('statemap').clientHeight,
          live: n('state-count-live'), snapshot: n('state-count-snapshot'), working: n('state-count-working'),
          free: n('state-count-free'), slots: Number(document.body.dataset.stateSlots),
          blocks_in_use: n('count-used') + n('count-shared')};
})()"""


@pytest.fixture(scope="module")
def hybrid_server():
    """The toy hybrid behind a real port: 32 state slots, the rest of 4 MiB for K/V."""
    engine = Engine(EngineConfig(kv_cache_memory=KV_MEMORY, **hybrid_options()),
                    loaded=with_tiny_tokenizer(toy_hybrid()))
    with serve_on_port(engine, "toy-hybrid") as base_url:
        yield base_url


def keep_busy(base_url: str, stop: threading.Event, statuses: list[int]) -> list[threading.Thread]:
    """Three clients sending long completions until `stop`: some request is always running."""
    def client(n: int) -> None:
        while not stop.is_set():
            body = {"prompt": f"The capital {n} is where the capital is", "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True}
            statuses.append(httpx.post(base_url + "/v1/completions", json=body, timeout=300).status_code)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    return threads


def test_state_strip_shows_live_slots_while_requests_run_and_snapshots_after(hybrid_server, browser, shots):
    browser.goto(hybrid_server + "/lab")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    idle = browser.evaluate(STATE_COUNTS)
    assert idle["shown"] and idle["slots"] == NUM_SLOTS and idle["height"] > 0
    assert (idle["live"], idle["free"]) == (0, NUM_SLOTS)
    assert "32 slots of 768 bytes" in browser.text("state-about")
    assert browser.text("model-info").endswith("· recurrent state 768 B/request")
    stop, statuses = threading.Event(), []
    threads = keep_busy(hybrid_server, stop, statuses)
    try:
        running = browser.wait_for(f"(() => {{ const c = {STATE_COUNTS}; return c.live > 0 ? c : null; }})()",
                                   timeout=120)
        browser.evaluate("document.getElementById('state-strip').scrollIntoView({block: 'center'})")
        browser.screenshot(shots / "lab-state-slots.png", full_page=False)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    assert statuses and set(statuses) == {200}
    assert running["live"] + running["snapshot"] + running["working"] + running["free"] == NUM_SLOTS
    # Drawn from the block view, at the step the block map shows: live states while blocks are in use.
    assert running["blocks_in_use"] > 0
    report = httpx.get(hybrid_server + "/v1/kv_cache", timeout=60).json()["recurrent_state"]
    assert report["live"] == 0 and report["snapshots"] > 0
    after = browser.wait_for(f"(() => {{ const c = {STATE_COUNTS}; return c.live === 0 && c.snapshot > 0 ? c : null; }})()",
                             timeout=60)
    assert after["snapshot"] == report["snapshots"]  # held snapshots count as working; none is held now
    assert browser.text("state-evicted").replace(",", "") == str(report["evicted"])


def test_memory_calculator_shows_both_kinds_for_a_hybrid(hybrid_server, browser, shots):
    browser.goto(hybrid_server + "/lab/memory?model=Qwen3.5-0.8B&context=32768&batch=4")
    browser.wait_for("document.body.dataset.ready && document.body.dataset.ready !== 'error'")
    assert browser.evaluate("document.getElementById('hybrid-kinds').style.display") == ""
    assert browser.text("attention-layers") == "6" and browser.text("recurrent-layers") == "18"
    assert browser.text("kv-per-token") == "12,288" and browser.text("state-per-request") == "20,201,472"
    assert browser.text("state-formula") == ("18 recurrent layers x (6,144 x 3 + 16 x 128 x 128) x 4 B "
                                             "= 20,201,472 bytes/state")
    assert browser.evaluate("parseFloat(document.getElementById('bar-state').style.width)") > 0
    browser.screenshot(shots / "lab-memory-hybrid.png")
    browser.goto(hybrid_server + "/lab/memory?model=Llama-3.1-8B&context=8192")  # every layer attends
    browser.wait_for("document.body.dataset.ready && document.body.dataset.ready !== 'error'")
    assert browser.evaluate("document.getElementById('hybrid-kinds').style.display") == "none"
    assert browser.evaluate("document.getElementById('bar-state').style.width") == "0px"
    assert browser.text("formula-title") == "Bytes per token of KV"
