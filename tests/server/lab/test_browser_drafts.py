"""Speculative decoding on the cache map, in a real headless Chromium against `kvserve serve --speculative
ngram` (embedded model): while a repetitive prompt (drafts accepted) and a counting one (drafts rejected,
the next number is not in the context) decode, draft slots are drawn over their blocks (accepted
ones hatched, rolled-back ones outlined), with a legend and counters that agree with /metrics.

The screenshot goes to pytest's temporary folder and, with KVSERVE_LAB_SCREENSHOTS=DIR, to DIR too.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.lab.browser import requires_chromium

pytestmark = [pytest.mark.browser, requires_chromium]
BROWSER_HEIGHT = 900  # the cache map and its legend in one screen (conftest's browser fixture)

PROMPTS = ["def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 12,
           "".join(f"x{n} = add({n}, {n + 1})\n" for n in range(1, 30))]


@pytest.fixture(scope="module")
def drafting_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("drafts-lab"), "--speculative", "ngram",
                          "--num-speculative-tokens", "6")
    yield server
    stop_server(server)
    assert server.process.returncode == 0, server.log()


def test_cache_map_draws_draft_slots_written_and_rolled_back(drafting_server, browser, tmp_path):
    browser.goto(drafting_server.base_url + "/lab")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    assert browser.evaluate("getComputedStyle(document.getElementById('draft-legend')).display") != "none"
    statuses: list[int] = []

    def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
        statuses.append(httpx.post(drafting_server.api_url + "/completions", json=body, timeout=900).status_code)

    threads = [threading.Thread(target=one, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    # Draft slots on the map, both kinds at once (accepted hatched, rejected outlined) in one step's view.
    data = "document.body.dataset"
    browser.wait_for(f"Number({data}.draftCells) > 0 && Number({data}.draftKept) > 0 && Number({data}.draftRolledBack) > 0",
                     timeout=120)
    browser.screenshot(tmp_path / "lab-drafts.png", full_page=False)
    block = browser.evaluate("[...state.drafts.keys()][0]")
    assert browser.evaluate(f"drafts.describe(state.drafts.get({block}))").startswith("slots ")
    for thread in threads:
        thread.join()
    assert statuses == [200, 200]
    drafting_server.wait_idle()
    # The counters' totals are the engine's: the same draft tokens /metrics counted.
    written = drafting_server.metric("kvserve:spec_decode_num_draft_tokens_total")
    browser.wait_for(f"Number(document.body.dataset.draftsWritten) === {int(written)}")
    assert written > 0
    assert browser.text("drafts-total").startswith("· in total ")
    legend = browser.text("draft-legend")
    assert "draft slot, accepted" in legend and "rolled back" in legend
