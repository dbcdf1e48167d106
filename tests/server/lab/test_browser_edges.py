"""Issue 27's lab items in a real headless Chromium against a real `kvserve serve`: a pool of ~11,650
blocks (the default pool's size) where a few requests must still show on the cache map, counters and
chart from one snapshot, the explainer's answer in view, charts with axes, and the key prompt said once.

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

pytestmark = [pytest.mark.browser, requires_chromium]
BROWSER_HEIGHT = 900  # the cache map and its legend in one screen (conftest's browser fixture)

TENANT, ADMIN = {"Authorization": "Bearer ka"}, "adm"


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    """2 GiB of float32 KV in blocks of 4 tokens: 11,650 blocks, as the default pool on the issue's machine."""
    server = start_server(tmp_path_factory.mktemp("big-lab"), "--kv-cache-memory", "2GiB", "--block-size", "4",
                          "--api-key", "ka", "--admin-key", ADMIN, api_key="ka")
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log()


def open_as_admin(browser: Browser, server, path: str) -> None:
    """Open a lab page with the admin key in the tab's session storage (where the key bar puts it)."""
    browser.goto(server.base_url + "/lab/static/lab.css")  # same origin, no page script
    browser.evaluate(f"sessionStorage.setItem('kvserve-admin-key', {json.dumps(ADMIN)})")
    browser.goto(server.base_url + path)


def traffic(server, statuses: list[int], count: int = 3, output: int = 60) -> list[threading.Thread]:
    def one(i: int) -> None:
        body = {"prompt": f"Request {i}: tell a long story about paged attention and blocks.", "max_tokens": output,
                "temperature": 0, "ignore_eos": True}
        statuses.append(httpx.post(server.api_url + "/completions", headers=TENANT, json=body, timeout=300).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


# Per in-use block: the colour drawn at the centre of its cell, read back from the canvas.
IN_USE_CELLS = """(() => {
  const v = state.view, l = state.layout, canvas = document.getElementById('blockmap');
  if (!v || !l) return {cells: []};
  const ctx = canvas.getContext('2d'), ratio = canvas.width / l.width, seen = new Set(), cells = [];
  v.ref.forEach((ref, id) => {
    const cell = Math.floor(id / l.group);
    if (ref === 0 || seen.has(cell)) return;
    seen.add(cell);
    const x = (cell % l.columns + 0.45) * l.cell, y = (Math.floor(cell / l.columns) + 0.45) * l.cell;
    const [r, g, b] = ctx.getImageData(Math.floor(x * ratio), Math.floor(y * ratio), 1, 1).data;
    const rect = canvas.getBoundingClientRect();
    cells.push({id, cell, rgb: [r, g, b], x: rect.left + x, y: rect.top + y});
  });
  return {group: l.group, cell: l.cell, cells, step: v.step};
})()"""
USED, SHARED = [0x2F, 0x9E, 0x5B], [0xE0, 0x67, 0x2B]
SAME_FRAME = """(() => { const n = (id) => Number(document.getElementById(id).textContent.replace(/[^0-9]/g, ''));
  const now = document.getElementById('now-usage').textContent;
  return {cards: n('count-used') + n('count-shared'), chart: Number(now.split('(')[1].replace(/[^0-9]/g, '')),
          updates: Number(document.body.dataset.updates)}; })()"""


def test_the_key_prompt_is_said_once(big_server, browser, shots):
    browser.goto(big_server.base_url + "/lab")
    browser.wait_for("!!document.getElementById('keybar')")
    bar = browser.evaluate("document.querySelector('#keybar span').textContent")
    subtitle = browser.text("feed-state")
    assert "--admin-key" in bar or "admin key" in bar
    assert bar not in subtitle and subtitle == "waiting for the admin key"
    browser.screenshot(shots / "lab-key-prompt.png", full_page=False)


def test_a_few_requests_show_on_a_map_of_11650_blocks(big_server, browser, shots):
    open_as_admin(browser, big_server, "/lab")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    assert browser.text("count-total") == "11,650"
    statuses: list[int] = []
    threads = traffic(big_server, statuses)
    shown, frames = None, []
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        frames.append(browser.evaluate(SAME_FRAME))
        cells = browser.evaluate(IN_USE_CELLS)
        if cells["cells"] and shown is None:
            shown = cells
            browser.screenshot(shots / "lab-cache-map-large.png", full_page=False)
        time.sleep(0.1)
    assert shown is not None, "no block in use was ever drawn"
    assert shown["group"] > 1 and shown["cell"] >= 8  # aggregated, in cells a person can see and hover
    assert f"Each cell is {shown['group']:,} blocks" in browser.text("map-scale")
    for cell in shown["cells"]:  # every cell holding a block in use is drawn in a colour of use
        assert cell["rgb"] in (USED, SHARED), cell
    # Counters and chart from one snapshot: the same number of blocks in use in every frame.
    assert frames and all(f["cards"] == f["chart"] for f in frames), frames
    assert any(f["cards"] > 0 for f in frames)
    for thread in threads:
        thread.join()
    assert statuses == [200] * len(threads)


def test_hover_names_the_exact_blocks_of_an_aggregated_cell(big_server, browser):
    statuses: list[int] = []
    threads = traffic(big_server, statuses, count=1, output=200)
    open_as_admin(browser, big_server, "/lab")
    cells = browser.wait_for(f"(() => {{ const c = {IN_USE_CELLS}; return c.cells.length && c; }})()", timeout=60)
    cell = cells["cells"][0]
    browser.mouse_move(cell["x"], cell["y"])
    title = browser.wait_for("document.querySelector('#block-info h2')?.textContent.startsWith('Blocks') && "
                             "document.querySelector('#block-info h2').textContent")
    first, last = (int(x) for x in title.split()[1].split("–"))
    assert first == cell["cell"] * cells["group"] and last == first + cells["group"] - 1
    assert str(cell["id"]) in browser.text("info-busy").split(", ")
    assert browser.text("info-holders") != "nobody"
    for thread in threads:
        thread.join()


def test_the_explainers_answer_is_in_view(big_server, browser, shots):
    for i in range(32):  # the lab keeps the last 32: a full table above the answer
        httpx.post(big_server.api_url + "/completions", headers=TENANT, timeout=60,
                   json={"prompt": f"Note {i}: the platform team meets on Monday.", "max_tokens": 1})
    open_as_admin(browser, big_server, "/lab/explain")
    browser.wait_for("document.querySelectorAll('#recent tbody tr').length >= 32")
    browser.evaluate("[...document.querySelectorAll('#recent tbody tr')].at(-1).click()")
    browser.wait_for("document.body.dataset.explained !== undefined")
    browser.screenshot(shots / "lab-explain-in-view.png", full_page=False)
    # The answer (its title down to its reason) is inside the window, with no scrolling by hand.
    assert browser.wait_for("(() => { const top = document.getElementById('result-panel').getBoundingClientRect().top;"
                            " const end = document.getElementById('explain-reason').getBoundingClientRect().bottom;"
                            " return top >= 0 && end <= innerHeight; })()")


def test_step_charts_have_axes(big_server, browser, shots):
    open_as_admin(browser, big_server, "/lab/steps")
    browser.set_input("max-tokens", 8)
    browser.evaluate("document.getElementById('run').click()")
    assert browser.wait_for("document.body.dataset.done", timeout=120) == "1", browser.text("steps-status")
    # Axis labels are drawn left of the plot: the canvas's left margin has ink (grey text) in it.
    inked = browser.evaluate("""['chart-step-tokens', 'chart-cumulative', 'chart-ms'].map((id) => {
      const c = document.getElementById(id), d = c.getContext('2d').getImageData(0, 0, 20, c.height).data;
      let ink = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) ink++; return ink; })""")
    assert all(ink > 0 for ink in inked), inked
    # The y axis's top is a round number in the chart's unit, above every value drawn.
    assert browser.evaluate("[lab.roundUp(27.3), lab.roundUp(548), lab.roundUp(100), lab.tick(30, ' tok')]") == [
        30, 600, 100, "30 tok"]
    browser.screenshot(shots / "lab-steps-axes.png", full_page=False)
