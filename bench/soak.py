"""Soak (issue 42): a bounded mixed load on 127.0.0.1 for --minutes, two tenants; the server must not grow,
fail or leak.

Starts `kvserve serve` on the embedded model (two API keys, an admin key), then --clients workers, each
looping over: a chat completion, a chat with tools, a structured output (json_schema), a Responses chain (a
turn, then one on previous_response_id), an Anthropic Messages call, and a stream cancelled after a few
chunks; the tenants alternate. Every --sample seconds it records the server's RSS. At the end it waits for the
server to go idle and reads /v1/kv_cache (admin): integrity and blocks held.

Prints RSS over time and its growth after warm-up (the first sample past --warmup-fraction of the run), the
count of requests by kind and status (any 5xx is a failure), integrity, and blocks held at the end. Never
asserts: read the verdict lines.

    .venv/bin/python bench/soak.py [--minutes 30] [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from pathlib import Path

import httpx

from serve import start_server
from workloads import save

KEYS, ADMIN = ("soak-tenant-a", "soak-tenant-b"), "soak-admin"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def post(http: httpx.AsyncClient, url: str, key: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return await http.post(url, json=body, headers={"Authorization": f"Bearer {key}", **(headers or {})})


async def one_round(http: httpx.AsyncClient, base: str, key: str, n: int, counts: collections.Counter,
                    model: str) -> None:
    api = base + "/v1"
    note = lambda kind, status: counts.update([(kind, status // 100 * 100)])  # noqa: E731
    chat = {"messages": [{"role": "user", "content": f"Say hello number {n}."}], "max_tokens": 12, "temperature": 0}
    note("chat", (await post(http, api + "/chat/completions", key, chat)).status_code)
    tools = {**chat, "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
             "tool_choice": "required", "max_tokens": 40}
    note("tools", (await post(http, api + "/chat/completions", key, tools)).status_code)
    structured = {**chat, "max_tokens": 40,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    note("structured", (await post(http, api + "/chat/completions", key, structured)).status_code)
    first = await post(http, api + "/responses", key, {"input": f"Name a colour ({n}).", "max_output_tokens": 8})
    note("responses", first.status_code)
    if first.status_code == 200:
        follow = {"input": "And another one?", "max_output_tokens": 8, "previous_response_id": first.json()["id"]}
        note("responses_chain", (await post(http, api + "/responses", key, follow)).status_code)
    messages = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": f"Count to {n % 5 + 2}."}]}
    note("messages", (await post(http, api + "/messages", key, messages, {"x-api-key": key})).status_code)
    stream = {"prompt": "Tell a long story about a lighthouse keeper.", "max_tokens": 200, "stream": True,
              "ignore_eos": True}
    async with http.stream("POST", api + "/completions", json=stream,
                           headers={"Authorization": f"Bearer {key}"}) as response:
        note("stream_cancelled", response.status_code)
        chunks = 0
        async for line in response.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 5:
                break  # the client goes away mid-stream: the server must abort and free its blocks


async def worker(index: int, http: httpx.AsyncClient, base: str, deadline: float, counts: collections.Counter,
                 failures: list[str], model: str) -> None:
    n = 0
    while time.monotonic() < deadline:
        try:
            await one_round(http, base, KEYS[(index + n) % 2], n, counts, model)
        except httpx.HTTPError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        n += 1


async def run(base: str, pid: int | None, args: argparse.Namespace) -> dict:
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    samples: list[tuple[float, int]] = []
    started = time.monotonic()
    deadline = started + 60 * args.minutes
    async with httpx.AsyncClient(timeout=600) as http:
        # Messages names the model it asks for (Anthropic's API requires it): the one this server serves.
        models = await http.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
        model = models.json()["data"][0]["id"]
        workers = [asyncio.create_task(worker(i, http, base, deadline, counts, failures, model))
                   for i in range(args.clients)]
        while time.monotonic() < deadline:
            if pid is not None:
                samples.append((time.monotonic() - started, rss_bytes(pid)))
                print(f"t={samples[-1][0]:6.0f}s RSS {samples[-1][1] / 2**20:7.1f} MiB  requests "
                      f"{sum(counts.values())}", flush=True)
            await asyncio.sleep(min(args.sample, max(deadline - time.monotonic(), 0.1)))
        await asyncio.gather(*workers)
        for _ in range(600):  # idle: nothing running or waiting (aborts of cancelled streams land too)
            report = (await http.get(base + "/v1/kv_cache", headers={"Authorization": f"Bearer {ADMIN}"})).json()
            if report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.5)
        if pid is not None:
            samples.append((time.monotonic() - started, rss_bytes(pid)))
    return {"counts": {f"{kind} {status}": n for (kind, status), n in sorted(counts.items())},
            "client_failures": failures[:20], "num_client_failures": len(failures), "rss": samples,
            "integrity": report["integrity"], "blocks_held_at_end": report["num_used_blocks"],
            "tenants": report.get("tenants")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample", type=float, default=15.0, help="seconds between RSS samples")
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    process, url = start_server(["--kv-cache-memory", args.kv_cache_memory, "--api-key", KEYS[0],
                                 "--api-key", KEYS[1], "--admin-key", ADMIN])
    try:
        result = asyncio.run(run(url.removesuffix("/v1"), process.pid, args))
    finally:
        process.terminate()
        process.wait(timeout=60)
    samples = result["rss"]
    warm = next((rss for t, rss in samples if t >= args.warmup_fraction * 60 * args.minutes), samples[0][1])
    growth = samples[-1][1] / warm - 1 if warm else float("nan")
    server_errors = sum(n for key, n in result["counts"].items() if key.endswith(" 500"))
    print(json.dumps(result["counts"], indent=1))
    print(f"RSS after warm-up {warm / 2**20:.1f} MiB, at the end {samples[-1][1] / 2**20:.1f} MiB: growth "
          f"{growth:+.1%} [goal < 5%: {'met' if growth < 0.05 else 'NOT met'}]")
    print(f"5xx: {server_errors} [goal 0: {'met' if server_errors == 0 else 'NOT met'}]; client-side failures "
          f"{result['num_client_failures']}")
    print(f"integrity {result['integrity']}; blocks held at the end {result['blocks_held_at_end']} "
          f"[goal 0: {'met' if result['blocks_held_at_end'] == 0 else 'NOT met'}]")
    path = save("soak", {"args": vars(args), "rss_growth_after_warmup": growth, "server_errors": server_errors,
                         **result})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
