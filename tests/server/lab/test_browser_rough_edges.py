"""Issue 46's lab edges in a real headless Chromium against `kvserve serve` (embedded model) at the default
pool's size (4 GiB of float16 KV: 11,650 blocks, drawn several to a cell) with drafting on: request ids
stay inside the block panel, a grouped map still shows each drafted block's slots (close up) and the
hovered cell's drafts, the explainer paints yellow only what matched a cached block, and the memory
calculator opens on the served model.

Screenshots go to pytest's temporary folder and, with KVSERVE_LAB_SCREENSHOTS=DIR, to DIR too.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.lab.browser import requires_chromium
from tests.server.lab.test_browser import read_plan, wait_shown
from tests.server.lab.test_memory import cli_json

pytestmark = [pytest.mark.browser, requires_chromium]
BROWSER_HEIGHT = 900  # the cache map and its legend in one screen (conftest's browser fixture)

# Drafts accepted (a repetitive prompt) and rejected (the next number is not in the context).
PROMPTS = ["def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 12,
           "".join(f"x{n} = add({n}, {n + 1})\n" for n in range(1, 30))]


@pytest.fixture(scope="module")
def default_pool_server(tmp_path_factory):
    """The default pool's 11,650 blocks of 16 tokens (4 GiB of float16 KV), n-gram drafting on."""
    server = start_server(tmp_path_factory.mktemp("edges-lab"), "--kv-cache-memory", "4GiB", "--kv-cache-dtype",
                          "float16", "--allow-kv-overcommit", "--speculative", "ngram",
                          "--num-speculative-tokens", "6")  # overcommit: the pool's pages are touched only as used
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log()


def drafting_traffic(server, statuses: list[int], prompts: list[str], max_tokens: int) -> list[threading.Thread]:
    def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        statuses.append(httpx.post(server.api_url + "/completions", json=body, timeout=900).status_code)

    threads = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    return threads


# Where the cell holding a block is on the screen, and which blocks that cell covers.
CELL_OF = """((id) => {
  const l = state.layout, rect = document.getElementById('blockmap').getBoundingClientRect();
  const cell = Math.floor(id / l.group);
  return {cell, first: cell * l.group, last: cell * l.group + l.group - 1, group: l.group,
          x: rect.left + (cell % l.columns + 0.5) * l.cell, y: rect.top + (Math.floor(cell / l.columns) + 0.5) * l.cell};
})"""


def test_the_memory_calculator_opens_on_the_served_model(default_pool_server, browser):
    served = httpx.get(default_pool_server.base_url + "/lab/api/info", timeout=60).json()["model"]
    assert served == "SmolLM2-135M-Instruct"
    browser.goto(default_pool_server.base_url + "/lab/memory")
    wait_shown(browser, model=served, context="8192")
    assert browser.evaluate("document.getElementById('model').value") == served
    assert browser.evaluate("document.getElementById('model').selectedOptions[0].textContent").startswith(
        f"{served}, served")
    # The figures are `kvserve memory`'s for the embedded model (what it plans with no name) at the page's
    # default 80 GiB.
    page, cli = read_plan(browser), cli_json(["--memory", "80GiB"])
    assert cli["model"] == served and page["formula"] == cli["formula"]
    for key in ("kv_bytes_per_request", "kv_bytes_total", "total_bytes", "max_concurrent_requests",
                "max_context_for_batch"):
        assert page[key] == cli[key], key
    assert f"model={served}" in browser.evaluate("location.search")


def test_the_explainer_paints_yellow_only_what_matched_a_cached_block(default_pool_server, browser, shots):
    cached = "The platform team meets on Monday at ten in room 4B to talk about caching and latency. " * 3
    assert httpx.post(default_pool_server.api_url + "/completions",
                      json={"prompt": cached, "max_tokens": 1}, timeout=120).status_code == 200
    pasted = cached + "Then a new topic entirely: zebras juggling violet umbrellas under the moon."
    report = httpx.post(default_pool_server.base_url + "/lab/api/explain", json={"prompt": pasted}, timeout=120).json()
    assert report["num_cached_tokens"] > 0 and report["divergence_position"] is None, report["reason"]
    browser.goto(default_pool_server.base_url + "/lab/explain")
    browser.evaluate(f"document.getElementById('prompt').value = {json.dumps(pasted)}")
    browser.evaluate("document.getElementById('explain').click()")
    assert browser.wait_for("document.body.dataset.explained") == str(report["num_cached_tokens"])
    shown = browser.evaluate("""Object.fromEntries(['hl-cached', 'hl-matched', 'hl-rest'].map((c) =>
        [c, [...document.querySelectorAll('#explain-prompt .' + c)].map((e) => e.textContent).join('')]))""")
    assert shown["hl-matched"] == ""  # nothing cached goes on past the cached prefix: nothing is yellow
    assert shown["hl-cached"] + shown["hl-rest"] == pasted and "zebras" in shown["hl-rest"]
    browser.screenshot(shots / "lab-explain-no-match.png", full_page=False)


def test_request_ids_stay_inside_the_block_panel(default_pool_server, browser, shots):
    browser.goto(default_pool_server.base_url + "/lab")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    statuses: list[int] = []
    threads = drafting_traffic(default_pool_server, statuses, PROMPTS[:1], max_tokens=40)
    held = browser.wait_for("(() => { const v = state.view; if (!v) return null;"
                            " const id = v.ref.findIndex((r) => r > 0); return id >= 0 && {id}; })()", timeout=180)
    at = browser.evaluate(f"{CELL_OF}({held['id']})")
    browser.evaluate(f"state.selected = {at['cell']}; drawMap()")  # pinned: the panel stays on this cell
    holders = browser.wait_for("(() => { const h = document.getElementById('info-holders')?.textContent || '';"
                               " return h.includes('cmpl-') && h; })()")
    assert len(max(holders.split(", "), key=len)) > 32  # an id longer than the panel is wide at this font
    overflow = browser.evaluate("""(() => { const panel = document.getElementById('block-info');
      const right = panel.getBoundingClientRect().right;
      return {scroll: panel.scrollWidth, client: panel.clientWidth,
              beyond: [...panel.querySelectorAll('dd')].filter((dd) => dd.getBoundingClientRect().right > right)
                        .map((dd) => dd.id)}; })()""")
    assert overflow["scroll"] <= overflow["client"] and overflow["beyond"] == [], overflow
    browser.screenshot(shots / "lab-block-panel-ids.png", full_page=False)
    browser.evaluate("state.selected = null; drawMap()")
    for thread in threads:
        thread.join()
    assert statuses == [200]


def test_a_grouped_map_shows_draft_slots_close_up_and_in_the_cell_panel(default_pool_server, browser, shots):
    browser.goto(default_pool_server.base_url + "/lab")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    assert browser.text("count-total") == "11,650"
    statuses: list[int] = []
    # Long enough that the map's polls land on several drafting steps: with 100 tokens the traffic could end
    # before the map had drawn a step with both kept and rolled-back slots (one run in four, once steps got faster).
    threads = drafting_traffic(default_pool_server, statuses, PROMPTS, max_tokens=400)
    data = "document.body.dataset"
    browser.wait_for(f"Number({data}.draftCells) > 0 && Number({data}.draftKept) > 0 && "
                     f"Number({data}.draftRolledBack) > 0", timeout=180)
    assert browser.evaluate("state.layout.group") > 1  # several blocks per cell, as at the default pool size
    assert browser.evaluate("getComputedStyle(document.getElementById('draft-closeup')).display") != "none"
    browser.screenshot(shots / "lab-drafts-grouped.png", full_page=False)
    # The close-up has ink: its blocks and their slots are drawn.
    assert browser.evaluate("""(() => { const c = document.getElementById('draft-closeup-map');
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let ink = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) ink++; return ink; })()""") > 0
    # Hovering a cell that holds a drafted block names that block's slots in the panel.
    described, deadline = None, time.monotonic() + 120
    while described is None and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        block = browser.evaluate("[...state.drafts.keys()][0] ?? null")
        if block is None:
            time.sleep(0.1)
            continue
        at = browser.evaluate(f"{CELL_OF}({block})")
        browser.mouse_move(at["x"], at["y"])
        text = browser.evaluate("document.getElementById('info-drafts')?.textContent || ''")
        if text.startswith("block "):
            described = (at, text)
    assert described is not None, "no hovered cell ever named its drafted blocks"
    at, text = described
    assert browser.text("block-info").startswith(f"Blocks {at['first']}–{at['last']}")
    block = int(text.split()[1].rstrip(":"))
    assert at["first"] <= block <= at["last"] and "slots " in text
    for thread in threads:
        thread.join()
    assert statuses == [200, 200]
