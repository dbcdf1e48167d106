"""Noisy neighbour (issue 42): is a shared server fair to a quiet tenant while another floods it?

One server on the embedded model (`--kv-cache-memory 96MiB`, two API keys), one sitting, three phases:

1. B alone: tenant B repeats one request, a ~1,400-token system prompt (the same each time) and a short
   question (new each time); its TTFT and how much of its prompt came from the cache.
2. A alone beside an idle B: tenant A floods, --streams concurrent clients each sending unique ~2,000-token
   prompts back to back; A's throughput (tokens the server computed for A per second: the per-tenant
   `num_scheduled_tokens` of the admin's /v1/kv_cache, so a slow machine's few finished requests do not
   quantize it).
3. Both: the same flood, and B's requests among it; B's TTFT and cached fraction, and A's throughput.

The goal (issue 42): B keeps >= 90% of its prefix cached and its TTFT within 3x of alone, and A's throughput
in phase 3 stays within 10% of phase 2. Prints each figure and the verdicts; never asserts (a benchmark).

    .venv/bin/python bench/noisy_neighbour.py [--seconds 90] [--streams 8] [--b-requests 6] [--url URL/v1]
        [--step-target-ms MS]   (0: the server never cuts a step, for the comparison)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import numpy as np

from kvserve.server.core.tenancy import tenant_id
from serve import start_server
from workloads import save

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "noisy-admin-key"


async def stream_completion(http: httpx.AsyncClient, url: str, key: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    usage: dict = {}
    async with http.stream("POST", url + "/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                           ) as response:
        if response.status_code != 200:
            return {"error": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("choices") and first is None:
                first = time.perf_counter()
            if payload.get("usage"):
                usage = payload["usage"]
    return {"ttft": (first or time.perf_counter()) - started, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "tokens": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)}


async def tenant_b(http: httpx.AsyncClient, url: str, system: list[int], count: int, gap_s: float,
                   rng: np.random.Generator) -> list[dict]:
    results = []
    for _ in range(count):
        question = rng.integers(1000, 40000, 24).tolist()  # a new question after the same system prompt
        results.append(await stream_completion(http, url, KEY_B, system + question, 16))
        await asyncio.sleep(gap_s)
    return results


async def scheduled_tokens(http: httpx.AsyncClient, url: str, key: str) -> int:
    """Tokens the server has given `key`'s requests in steps so far (the admin's per-tenant report)."""
    report = (await http.get(url.removesuffix("/v1") + "/v1/kv_cache",
                             headers={"Authorization": f"Bearer {ADMIN}"})).json()
    return next((t["num_scheduled_tokens"] for t in report["tenants"] if t["tenant"] == tenant_id(key)), 0)


async def flood(http: httpx.AsyncClient, url: str, streams: int, prompt_tokens: int, output: int,
                stop: asyncio.Event, seed: int) -> dict:
    """A's flood until `stop`: its throughput is the tokens the server computed for A per second (counted
    by the server, so requests still in flight at either end count for what was done of them)."""
    finished: list[dict] = []
    errors = 0

    async def client(index: int) -> None:
        nonlocal errors
        rng = np.random.default_rng(seed * 1000 + index)
        while not stop.is_set():
            result = await stream_completion(http, url, KEY_A, rng.integers(1000, 40000, prompt_tokens).tolist(),
                                             output)
            if "error" in result:
                errors += 1
                await asyncio.sleep(0.5)
            elif not stop.is_set():
                finished.append(result)

    before = await scheduled_tokens(http, url, KEY_A)
    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    started = time.perf_counter()
    await stop.wait()
    elapsed = time.perf_counter() - started
    computed = await scheduled_tokens(http, url, KEY_A) - before
    for task in tasks:
        task.cancel()  # the server aborts what they had in flight
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"requests": len(finished), "errors": errors, "seconds": elapsed, "tokens_per_s": computed / elapsed,
            "finished_tokens_per_s": sum(r["tokens"] for r in finished) / elapsed}


async def run(url: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(42)
    system = rng.integers(1000, 40000, args.system_tokens).tolist()
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=args.streams + 8)) as http:
        await tenant_b(http, url, system, 1, 0.0, rng)  # warm-up: B's prefix enters the cache
        alone = await tenant_b(http, url, system, args.b_requests, 0.5, rng)
        print(f"B alone: TTFT median {statistics.median(r['ttft'] for r in alone):.2f} s, cached "
              f"{sum(r['cached'] for r in alone) / sum(r['prompt_tokens'] for r in alone):.0%}", flush=True)

        stop = asyncio.Event()
        flood_task = asyncio.create_task(flood(http, url, args.streams, args.flood_tokens, args.output, stop, 1))
        await asyncio.sleep(args.seconds)
        stop.set()
        a_alone = await flood_task
        print(f"A alone beside an idle B: {a_alone['tokens_per_s']:.0f} tok/s ({a_alone['requests']} requests)",
              flush=True)

        stop = asyncio.Event()
        flood_task = asyncio.create_task(flood(http, url, args.streams, args.flood_tokens, args.output, stop, 2))
        await asyncio.sleep(min(10.0, args.seconds / 4))  # the flood is under way (the pool full of A's work)
        gap = max(0.5, (args.seconds - 10.0) / max(args.b_requests, 1) / 2)
        under = await tenant_b(http, url, system, args.b_requests, gap, rng)
        await asyncio.sleep(max(0.0, args.seconds / 4))
        stop.set()
        a_with_b = await flood_task
        report = (await http.get(url.removesuffix("/v1") + "/v1/kv_cache",
                                 headers={"Authorization": f"Bearer {ADMIN}"})).json()
    return {"b_alone": alone, "a_alone": a_alone, "b_under_flood": under, "a_with_b": a_with_b,
            "integrity": report.get("integrity"), "tenants": report.get("tenants")}


def summarize(result: dict) -> dict:
    alone, under = result["b_alone"], result["b_under_flood"]
    under_ok = [r for r in under if "error" not in r]
    ttft_alone = statistics.median(r["ttft"] for r in alone)
    ttft_under = statistics.median(r["ttft"] for r in under_ok) if under_ok else float("inf")
    system_share = [r["cached"] / r["prompt_tokens"] for r in under_ok if r["prompt_tokens"]]
    a_ratio = result["a_with_b"]["tokens_per_s"] / max(result["a_alone"]["tokens_per_s"], 1e-9)
    summary = {
        "b_ttft_alone_s": ttft_alone, "b_ttft_under_flood_s": ttft_under, "b_ttft_ratio": ttft_under / ttft_alone,
        "b_ttft_under_flood_max_s": max((r["ttft"] for r in under_ok), default=float("inf")),
        "b_cached_fraction_min": min(system_share, default=0.0),
        "b_cached_fraction_mean": sum(system_share) / len(system_share) if system_share else 0.0,
        "b_errors": len(under) - len(under_ok),
        "a_tokens_per_s_alone": result["a_alone"]["tokens_per_s"],
        "a_tokens_per_s_with_b": result["a_with_b"]["tokens_per_s"], "a_throughput_ratio": a_ratio,
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each flood phase")
    parser.add_argument("--streams", type=int, default=8, help="tenant A's concurrent clients")
    parser.add_argument("--flood-tokens", type=int, default=2000, help="tokens of each of A's unique prompts")
    parser.add_argument("--system-tokens", type=int, default=1400, help="B's system prompt, the same each time")
    parser.add_argument("--output", type=int, default=16, help="output tokens of A's requests")
    parser.add_argument("--b-requests", type=int, default=6)
    parser.add_argument("--kv-cache-memory", default="96MiB")
    parser.add_argument("--step-target-ms", type=int, default=None,
                        help="the server's --step-target-ms (default: the engine's; 0: steps never cut)")
    parser.add_argument("--url", default=None, help="a running server (…/v1) with the keys above, instead of "
                                                    "starting one")
    args = parser.parse_args()
    process, url = (None, args.url) if args.url else start_server(
        ["--kv-cache-memory", args.kv_cache_memory, "--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN,
         *(["--step-target-ms", str(args.step_target_ms)] if args.step_target_ms is not None else [])])
    try:
        result = asyncio.run(run(url, args))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    summary = summarize(result)
    print(f"B TTFT: alone {summary['b_ttft_alone_s']:.2f} s, under the flood {summary['b_ttft_under_flood_s']:.2f} s "
          f"(median; max {summary['b_ttft_under_flood_max_s']:.2f} s) -> {summary['b_ttft_ratio']:.1f}x "
          f"[goal <= 3x: {'met' if summary['b_ttft_ratio'] <= 3 else 'NOT met'}]")
    print(f"B cached fraction under the flood: min {summary['b_cached_fraction_min']:.0%}, mean "
          f"{summary['b_cached_fraction_mean']:.0%} of the prompt [goal >= 90% of the prefix: "
          f"{'met' if summary['b_cached_fraction_min'] * (args.system_tokens + 24) >= 0.9 * args.system_tokens else 'NOT met'}]")
    print(f"A throughput: alone {summary['a_tokens_per_s_alone']:.0f} tok/s, beside B {summary['a_tokens_per_s_with_b']:.0f}"
          f" tok/s -> {summary['a_throughput_ratio']:.2f}x [goal >= 0.90: "
          f"{'met' if summary['a_throughput_ratio'] >= 0.9 else 'NOT met'}]")
    print(f"integrity: {result['integrity']}")
    path = save("noisy_neighbour", {"args": vars(args), "summary": summary, **result})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
