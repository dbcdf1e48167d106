"""The lab in a real headless Chromium against a real `kvserve serve` (embedded model) on 127.0.0.1.

Screenshots are kept in pytest's temporary folder (lab-screenshots*) and, with
KVSERVE_LAB_SCREENSHOTS=DIR, copied there too (that is how docs/lab-*.png are made).
"""

from __future__ import annotations

import json
import threading
from urllib.parse import urlencode

import httpx
import numpy as np
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.lab.browser import requires_chromium
from tests.server.lab.test_memory import cli_json

pytestmark = [pytest.mark.browser, requires_chromium]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("lab-server"))
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log()


PAGE_COUNTS = """(() => {
  const n = (id) => Number(document.getElementById(id).textContent.replace(/,/g, ''));
  return {step: Number(document.body.dataset.viewStep), total: n('count-total'), free: n('count-free'),
          cached: n('count-cached'), used: n('count-used'), shared: n('count-shared')};
})()"""


def traffic(base_url: str, statuses: list[int], count: int = 6, output: int = 40) -> list[threading.Thread]:
    """`count` requests sharing a 64-token prefix (so blocks are shared), each with its own tail."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(1000, 40000, 64).tolist()

    def one(tail: list[int]) -> None:
        body = {"prompt": prefix + tail, "max_tokens": output, "temperature": 0, "ignore_eos": True}
        statuses.append(httpx.post(base_url + "/v1/completions", json=body, timeout=300).status_code)

    threads = [threading.Thread(target=one, args=(rng.integers(1000, 40000, 20 + i).tolist(),)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def assert_counts_equal(page: dict, report: dict) -> None:
    assert page["total"] == report["num_blocks"]
    assert page["used"] + page["shared"] == report["num_used_blocks"]
    assert page["free"] + page["cached"] == report["num_free_blocks"]
    assert page["cached"] == report["num_cached_free_blocks"]


def test_cache_map_block_counts_equal_kv_cache_while_requests_run(lab_server, browser, shots):
    kv_cache_url = lab_server.api_url + "/kv_cache"
    browser.goto(lab_server.base_url + "/lab")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    statuses: list[int] = []
    threads = traffic(lab_server.base_url, statuses)
    reports: dict[int, dict] = {}
    matches: list[tuple[dict, dict]] = []
    while any(t.is_alive() for t in threads) and len(matches) < 5:
        report = httpx.get(kv_cache_url, timeout=120).json()  # answered between steps: waits for the one running
        if report["num_requests_running"]:
            reports[report["num_steps"]] = report
        page = browser.evaluate(PAGE_COUNTS)
        if page["step"] in reports and (not matches or matches[-1][0]["step"] != page["step"]):
            matches.append((page, reports[page["step"]]))
            if len(matches) == 2:
                browser.screenshot(shots / "lab-cache-map.png")
    assert matches, "the page never showed a step that /v1/kv_cache also reported while requests ran"
    for page, report in matches:  # same engine step, same numbers
        assert_counts_equal(page, report)
    assert any(page["shared"] > 0 for page, _ in matches)  # the common prefix is shared while they run

    # Hovering a cell shows its ref count and holders.
    cell = browser.evaluate("""(() => {
      const v = state.view, l = state.layout, id = v.ref.findIndex((r) => r > 0);
      if (id < 0) return null;
      const rect = document.getElementById('blockmap').getBoundingClientRect();
      return {id, ref: v.ref[id], x: rect.left + (id % l.columns + 0.5) * l.cell,
              y: rect.top + (Math.floor(id / l.columns) + 0.5) * l.cell};
    })()""")
    if cell is not None:  # the requests may all have finished by now
        browser.mouse_move(cell["x"], cell["y"])
        assert browser.wait_for("document.getElementById('info-ref')?.textContent")
        holders = browser.text("info-holders").split(", ")
        assert int(browser.text("info-ref")) == len(holders) >= 1

    for thread in threads:
        thread.join()
    assert statuses == [200] * len(threads)
    idle = lab_server.wait_idle()
    page = browser.wait_for(f"(() => {{ const p = {PAGE_COUNTS}; return p.step === {idle['num_steps']} && p; }})()")
    assert_counts_equal(page, idle)
    assert page["cached"] > 0 and page["used"] == page["shared"] == 0


def read_plan(browser: Browser) -> dict:
    def number(element_id: str) -> int:
        return int(browser.text(element_id).split()[0].replace(",", ""))

    return {"kv_bytes_per_request": number("kv-per-request-bytes"), "kv_bytes_total": number("kv-total-bytes"),
            "total_bytes": number("total-bytes"), "max_concurrent_requests": number("max-requests"),
            "max_context_for_batch": number("max-context"), "formula": browser.text("formula"),
            "weights": browser.text("weights"), "kv_total": browser.text("kv-total")}


def wait_shown(browser: Browser, **expected) -> None:
    """Until the figures on the page are those of a query with these parameters."""
    pairs = [urlencode({k: v}) for k, v in expected.items()]
    browser.wait_for(f"(() => {{ const q = document.body.dataset.ready || ''; "
                     f"return {json.dumps(pairs)}.every((p) => ('&' + q + '&').includes('&' + p + '&')); }})()")


SLIDER_CASES = [
    # (preset in the URL, controls moved: (element id, value), what the CLI is asked)
    ("Llama-3.1-8B", [("context-slider", 15), ("batch-slider", 4), ("kv_dtype", "int8"), ("weights_dtype", "int4"),
                      ("memory", "24GiB")],
     {"context": "32768", "batch": "4", "kv_dtype": "int8", "weights_dtype": "int4", "memory": "24GiB"},
     ["Llama-3.1-8B", "--context", "32768", "--batch", "4", "--kv-dtype", "int8", "--weights-dtype", "int4",
      "--memory", "24GiB"]),
    ("Llama-2-7B", [("context-slider", 12), ("batch-slider", 8), ("memory", "40GiB")],
     {"context": "4096", "batch": "8", "memory": "40GiB"},
     ["Llama-2-7B", "--context", "4096", "--batch", "8", "--memory", "40GiB"]),
    ("Qwen2.5-7B", [("context-slider", 17), ("batch-slider", 16), ("kv_dtype", "fp8_e4m3"), ("weights_dtype", "q4_k"),
                    ("memory", "80GiB"), ("overhead-slider", 20)],
     {"context": "131072", "batch": "16", "kv_dtype": "fp8_e4m3", "weights_dtype": "q4_k", "overhead": "0.2"},
     ["Qwen2.5-7B", "--context", "131072", "--batch", "16", "--kv-dtype", "fp8_e4m3", "--weights-dtype", "q4_k",
      "--memory", "80GiB", "--overhead", "0.2"]),
    ("Llama-3.1-8B", [("model", "custom"), ("layers", 24), ("kv_heads", 2), ("head_dim", 64), ("heads", 14),
                      ("params", 0.5), ("context-slider", 13), ("batch-slider", 3), ("kv_dtype", "int4"),
                      ("memory", "16GiB")],
     {"model": "custom", "layers": "24", "kv_heads": "2", "head_dim": "64", "heads": "14", "context": "8192",
      "batch": "3", "kv_dtype": "int4", "memory": "16GiB"},
     ["--layers", "24", "--kv-heads", "2", "--head-dim", "64", "--heads", "14", "--params", "5e8", "--context",
      "8192", "--batch", "3", "--kv-dtype", "int4", "--memory", "16GiB"]),
]


@pytest.mark.parametrize("preset, moves, shown, cli_args", SLIDER_CASES)
def test_calculator_sliders_give_the_cli_figures(lab_server, browser, preset, moves, shown, cli_args):
    browser.goto(f"{lab_server.base_url}/lab/memory?model={preset}")
    wait_shown(browser, model=preset)
    for element_id, value in moves:
        browser.set_input(element_id, value)
    wait_shown(browser, **shown)
    page, plan = read_plan(browser), cli_json(cli_args)
    assert page["formula"] == plan["formula"]
    for key in ("kv_bytes_per_request", "kv_bytes_total", "total_bytes", "max_concurrent_requests",
                "max_context_for_batch"):
        assert page[key] == plan[key], key


def test_the_url_reproduces_the_view(lab_server, browser, shots):
    browser.goto(f"{lab_server.base_url}/lab/memory?model=Llama-3.1-8B&context=131072&batch=1&kv_dtype=float16")
    wait_shown(browser, model="Llama-3.1-8B", context="131072", batch="1", kv_dtype="float16")
    assert browser.text("kv-total") == "16.00 GiB" and browser.text("kv-per-request") == "16.00 GiB"
    browser.screenshot(shots / "lab-memory.png")
    browser.set_input("batch-slider", 6)
    browser.set_input("kv_dtype", "int8")
    browser.set_input("memory", "141GiB")
    wait_shown(browser, batch="6", kv_dtype="int8", memory="141GiB")
    link, figures = browser.evaluate("location.href"), read_plan(browser)
    browser.goto(link)
    wait_shown(browser, batch="6", kv_dtype="int8", memory="141GiB")
    assert read_plan(browser) == figures
    assert browser.evaluate("[batch.value, kv_dtype.value, memory.value, model.value]") == [
        "6", "int8", "141GiB", "Llama-3.1-8B"]


def test_steps_page_runs_both_and_counts_each_step(lab_server, browser, shots):
    prompt = "The KV cache keeps the keys and values of every token, so that"
    usage = httpx.post(lab_server.api_url + "/completions", json={"prompt": prompt, "max_tokens": 1},
                       timeout=120).json()["usage"]
    num_prompt, max_tokens = usage["prompt_tokens"], 6
    browser.goto(lab_server.base_url + "/lab/steps")
    browser.evaluate(f"document.getElementById('prompt').value = {json.dumps(prompt)}")
    browser.set_input("max-tokens", max_tokens)
    browser.evaluate("document.getElementById('run').click()")
    assert browser.wait_for("document.body.dataset.done", timeout=120) == "1", browser.text("steps-status")
    rows = browser.evaluate("""[...document.querySelectorAll('#steps-table tbody tr')].map((tr) =>
        Object.fromEntries([...tr.children].map((td) => [td.dataset.col, td.textContent])))""")
    assert [int(r["step"]) for r in rows] == list(range(max_tokens))
    for k, row in enumerate(rows):
        assert int(row["recompute-tokens"]) == num_prompt + k and int(row["recompute-reused"]) == 0
        assert int(row["cached-tokens"]) == (num_prompt if k == 0 else 1)
        assert int(row["cached-reused"]) == (0 if k == 0 else num_prompt + k - 1)
        assert row["cached-ms"].endswith(" ms") and row["recompute-ms"].endswith(" ms")
    cumulative = sum(num_prompt + k for k in range(max_tokens))
    assert browser.text("total-recompute-tokens") == f"{cumulative:,}"
    assert browser.text("total-cached-tokens") == f"{num_prompt + max_tokens - 1:,}"
    browser.screenshot(shots / "lab-steps.png")


def test_explainer_shows_a_recent_request(lab_server, browser, shots):
    base = "Meeting notes for the platform team, Monday at 10:{} in room 4B. Agenda: caching, latency, costs."
    for minute in ("15", "45"):
        httpx.post(lab_server.api_url + "/completions", json={"prompt": base.format(minute), "max_tokens": 2},
                   timeout=120)
    recent = httpx.get(lab_server.base_url + "/lab/api/recent", timeout=60).json()["requests"][0]
    browser.goto(lab_server.base_url + "/lab/explain")
    browser.wait_for(f"!!document.querySelector('tr[data-request=\"{recent['id']}\"]')")
    browser.evaluate(f"document.querySelector('tr[data-request=\"{recent['id']}\"]').click()")
    assert browser.wait_for("document.body.dataset.explained") == str(recent["cached_tokens"])
    assert browser.text("explain-total") == str(recent["prompt_tokens"])
    assert f"at token {recent['divergence_position']}" in browser.text("explain-reason")
    browser.evaluate(f"document.getElementById('prompt').value = {json.dumps(base.format('50'))}")
    browser.evaluate("document.getElementById('explain').click()")
    browser.wait_for("!!document.querySelector('.hl-ours')")
    assert "5" in browser.evaluate("document.querySelector('.hl-ours').textContent")
    browser.screenshot(shots / "lab-explain.png")
