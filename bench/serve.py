"""W5 (DESIGN §5): N concurrent streaming clients over HTTP against `kvserve serve`.

Starts a server on the embedded model (or uses --url), then for each N in
--clients: N clients each stream one /v1/completions request (random-token
prompt, greedy, EOS ignored, so every request yields exactly --output tokens).
Reports TTFT and TPOT (per request) and inter-chunk latency p50/p99, output
tok/s and errors; and, as the baseline in the same run, the same requests
through the in-process Engine (no HTTP), so the ratio is the serving overhead.

    .venv/bin/python bench/serve.py [--clients 1 8 32] [--prompt 256] [--output 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from workloads import greedy, random_prompts, run_engine, save


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_client(http: httpx.AsyncClient, url: str, prompt: list[int], output: int) -> dict:
    body = {"prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    chunk_times: list[float] = []
    tokens = 0
    try:
        async with http.stream("POST", url + "/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("choices"):
                    chunk_times.append(time.perf_counter())
                elif payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    if not chunk_times:
        return {"error": "no chunks"}
    ttft = chunk_times[0] - started
    tpot = (chunk_times[-1] - chunk_times[0]) / max(tokens - 1, 1)
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return {"ttft": ttft, "tpot": tpot, "gaps": gaps, "tokens": tokens, "end": chunk_times[-1]}


async def run_clients(url: str, prompts: list[list[int]], output: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(http, url, p, output) for p in prompts))
    ok = [r for r in results if "error" not in r]
    wall = max((r["end"] for r in ok), default=started) - started
    gaps = [g for r in ok for g in r["gaps"]]
    return {
        "requests": len(prompts), "errors": len(results) - len(ok),
        "error_kinds": sorted({r["error"] for r in results if "error" in r}),
        "wall_s": wall, "output_tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile([r["ttft"] for r in ok], 50), "ttft_p99_s": percentile([r["ttft"] for r in ok], 99),
        "tpot_p50_ms": 1000 * percentile([r["tpot"] for r in ok], 50),
        "tpot_p99_ms": 1000 * percentile([r["tpot"] for r in ok], 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
    }


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", "0", *extra],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = re.search(r"on (http://[\d.]+:\d+/v1)", Path(log.name).read_text())
        if match:
            url = match.group(1)
            for _ in range(100):
                try:
                    if httpx.get(url.removesuffix("/v1") + "/health").status_code == 200:
                        return process, url
                except httpx.TransportError:
                    time.sleep(0.1)
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"server did not start:\n{Path(log.name).read_text()}")


def offline_baseline(prompts: list[list[int]], output: int, engine) -> dict:
    outputs, stats = run_engine(engine, prompts, greedy(output))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.ttft for o in outputs]
    tpots = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    return {"wall_s": stats["wall_s"], "output_tok_s": tokens / stats["wall_s"],
            "ttft_p50_s": percentile(ttfts, 50), "tpot_p50_ms": 1000 * percentile(tpots, 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="output tokens per request")
    parser.add_argument("--url", default=None, help="use a running server (…/v1) instead of starting one")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-process Engine comparison")
    args = parser.parse_args()

    process = None
    url = args.url
    if url is None:
        process, url = start_server(["--kv-cache-memory", args.kv_cache_memory])
    engine = None
    if not args.no_baseline:
        from kvserve.config import EngineConfig
        from kvserve.engine.engine import Engine

        # Prefix caching off in the baseline and distinct prompts per run: nothing is served from cache.
        engine = Engine(EngineConfig(kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False))
    rows = []
    try:
        for seed, n in enumerate(args.clients):
            # A fresh seed per N: no prompt repeats, so the server's prefix cache cannot flatter a later run.
            prompts = random_prompts(n, args.prompt, seed=100 + seed)
            served = asyncio.run(run_clients(url, prompts, args.output))
            row = {"clients": n, "server": served}
            if engine is not None:
                row["offline"] = offline_baseline(prompts, args.output, engine)
            rows.append(row)
            print(f"N={n:>3}  server: {served['output_tok_s']:6.1f} out tok/s  TTFT p50 {served['ttft_p50_s']:.2f} s "
                  f"p99 {served['ttft_p99_s']:.2f} s  TPOT p50 {served['tpot_p50_ms']:.1f} ms "
                  f"p99 {served['tpot_p99_ms']:.1f} ms  ITL p50 {served['itl_p50_ms']:.1f} ms "
                  f"p99 {served['itl_p99_ms']:.1f} ms  errors {served['errors']}", flush=True)
            if "offline" in row:
                off = row["offline"]
                print(f"       offline Engine: {off['output_tok_s']:6.1f} out tok/s  TTFT p50 {off['ttft_p50_s']:.2f} s"
                      f"  TPOT p50 {off['tpot_p50_ms']:.1f} ms  -> server/offline throughput "
                      f"{served['output_tok_s'] / off['output_tok_s']:.2f}x", flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    path = save("serve", {"workload": "W5", "prompt_tokens": args.prompt, "output_tokens": args.output, "runs": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
