"""What the lab's live feed costs the engine: W5 serving throughput with the cache-map page open vs closed.

Starts `kvserve serve` on the embedded model (or uses --url), then runs the
same W5 round (N concurrent streaming clients, random-token prompts, greedy,
EOS ignored) alternately with nobody watching and with the lab's cache map
open, --rounds times each, every round on fresh prompts (the prefix cache
never flatters a later round). "Open" is either a reader of the feed in this
process (`--watcher feed`: what the server pays, since it builds a block view
a few times a second and sends it) or a real headless Chromium showing /lab
(`--watcher chromium`: that, plus the browser's own CPU on this machine).
Prints output tok/s per round and the open/closed ratio; never asserts.

    .venv/bin/python bench/lab_feed_cost.py [--clients 8] [--prompt 256] [--output 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile

import httpx
import numpy as np

from serve import run_clients, start_server
from workloads import random_prompts, save


async def watch_feed(base_url: str, stop: asyncio.Event, counts: dict) -> None:
    """Read the feed as the page does (every event, every byte), until `stop`."""
    async with httpx.AsyncClient(timeout=None) as http:
        async with http.stream("GET", base_url + "/lab/api/feed") as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    counts["events"] += 1
                    counts["bytes"] += len(line)
                if stop.is_set():
                    return


async def round_with_feed(url: str, prompts: list[list[int]], output: int) -> tuple[dict, dict]:
    stop, counts = asyncio.Event(), {"events": 0, "bytes": 0}
    watcher = asyncio.create_task(watch_feed(url.removesuffix("/v1"), stop, counts))
    await asyncio.sleep(1.0)  # connected and streaming before the clients start
    served = await run_clients(url, prompts, output)
    stop.set()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    return served, counts


@contextlib.contextmanager
def chromium_page(url: str):
    """A headless Chromium showing `url` (its JavaScript running) for the duration."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("--watcher chromium needs Debian's chromium package (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        process = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                    f"--user-data-dir={profile}", "--window-size=1400,1000",
                                    "--remote-debugging-port=0", url],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield
        finally:
            process.kill()
            process.wait(timeout=10)


async def round_with_chromium(url: str, prompts: list[list[int]], output: int) -> tuple[dict, dict]:
    with chromium_page(url.removesuffix("/v1") + "/lab"):
        await asyncio.sleep(3.0)  # the browser starts and the page connects
        return await run_clients(url, prompts, output), {}


def view_cost(num_blocks: int, block_size: int, repeats: int = 50) -> tuple[float, float, float]:
    """Milliseconds to build one block view of a pool this size, half of it held by 16 requests (what the
    engine does once per tick while a page is open), and to encode it as the feed does; the view carries one
    step's draft slots (8 per request, half rolled back). Also milliseconds per step to record those slots
    (what the engine does every step with drafting on, page open or not)."""
    import time

    from kvserve.engine.spec_decode.slots import DraftSlotLog
    from kvserve.engine.observe.stats import take_block_view
    from kvserve.kv.manager import KVCacheManager
    from kvserve.server.lab.feed import block_view_json

    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    num_tokens, num_drafts = num_blocks // 32 * block_size, 8
    for request in range(16):
        kv.allocate_slots(str(request), num_tokens)
    log = DraftSlotLog(kv)
    started = time.perf_counter()
    for step in range(repeats):
        for request in range(16):
            pending = log.written(str(request), num_tokens - num_drafts - 1, num_drafts + 1, num_drafts)
            log.settled(pending, num_drafts, num_drafts // 2, num_tokens - num_drafts // 2)
        log.end_step(step)
    recorded = time.perf_counter()
    for _ in range(repeats):
        view = take_block_view(kv, 0, log.current)
    built = time.perf_counter()
    for _ in range(repeats):
        json.dumps(block_view_json(view), separators=(",", ":"))
    encoded = time.perf_counter()
    return (1000 * (built - recorded) / repeats, 1000 * (encoded - built) / repeats,
            1000 * (recorded - started) / repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=5, help="closed/open pairs, back to back")
    parser.add_argument("--watcher", choices=("feed", "chromium"), default="feed")
    parser.add_argument("--url", default=None, help="use a running server (…/v1) instead of starting one")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    args = parser.parse_args()

    process = None
    url = args.url
    if url is None:
        process, url = start_server(["--kv-cache-memory", args.kv_cache_memory])
    watched = round_with_feed if args.watcher == "feed" else round_with_chromium
    rows = []
    try:
        info = httpx.get(url.removesuffix("/v1") + "/lab/api/info").json()
        print(f"{info['model']}: {info['num_blocks']:,} KV blocks; {args.clients} clients x ({args.prompt} prompt, "
              f"{args.output} output); watcher: {args.watcher}", flush=True)
        asyncio.run(run_clients(url, random_prompts(2, 32, seed=999), 4))  # warm-up
        seed = 200
        for index in range(args.rounds):
            for mode in ("closed", "open"):
                seed += 1
                prompts = random_prompts(args.clients, args.prompt, seed=seed)
                if mode == "closed":
                    served, feed = asyncio.run(run_clients(url, prompts, args.output)), {}
                else:
                    served, feed = asyncio.run(watched(url, prompts, args.output))
                rows.append({"round": index, "mode": mode, "server": served, "feed": feed})
                extra = f"  feed: {feed['events']} events, {feed['bytes'] / 1024:.0f} KiB" if feed else ""
                print(f"round {index} {mode:>6}: {served['output_tok_s']:6.1f} out tok/s  wall {served['wall_s']:.1f} s"
                      f"  TPOT p50 {served['tpot_p50_ms']:.1f} ms  errors {served['errors']}{extra}", flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    closed = [r["server"]["output_tok_s"] for r in rows if r["mode"] == "closed"]
    opened = [r["server"]["output_tok_s"] for r in rows if r["mode"] == "open"]
    # Each pair ran back to back: the median of the pairs' ratios shrugs off a round that a neighbour's
    # load slowed down, which the ratio of means does not.
    pair_ratios = [o / c for o, c in zip(opened, closed)]
    ratio = float(np.median(pair_ratios))
    print(f"output tok/s: closed median {np.median(closed):.1f}, open median {np.median(opened):.1f}; "
          f"open/closed per pair {', '.join(f'{r:.3f}' for r in pair_ratios)}; median {ratio:.3f}")
    view_ms, json_ms, drafts_ms = view_cost(info["num_blocks"], info["block_size"])
    print(f"per feed tick, {info['num_blocks']:,} blocks: block view {view_ms:.2f} ms (engine thread, between steps), "
          f"JSON {json_ms:.2f} ms (event loop); per step, recording 16 requests' draft slots {drafts_ms:.3f} ms")
    path = save("lab_feed_cost", {"workload": "W5", "clients": args.clients, "prompt_tokens": args.prompt,
                                  "output_tokens": args.output, "watcher": args.watcher, "rounds": rows,
                                  "open_over_closed_pairs": pair_ratios, "open_over_closed_median": ratio,
                                  "block_view_ms": view_ms, "block_view_json_ms": json_ms,
                                  "draft_slots_per_step_ms": drafts_ms})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
