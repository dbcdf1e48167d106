"""W10: a multi-tenant prefix workload over replicas — cache-aware vs round-robin routing vs one server.

--prompts system prompts of --prefix-tokens tokens, each used by --uses short requests (the system prompt
plus a few tokens of their own), all shuffled, sent --concurrency at a time over HTTP (/v1/completions,
token ids, max_tokens 1, so the latency is the TTFT). Three setups, one after another in this run:

  cache_aware  --replicas kvserve replicas on Ray Serve (a local Ray), the cache-aware router
  round_robin  the same replicas, round-robin
  single       one `kvserve serve` whose pool is the replicas' pools together

Each replica's pool holds about prompts/replicas system prompts (a quarter with 4 replicas). Printed per
setup: aggregate prefix hit rate, prefill tokens computed, mean / p90 TTFT, requests per replica (the
`x-kvserve-replica` header) and the largest over the mean. Then what Ray costs: the resident memory of
Ray's own processes (GCS, raylet, controller, proxy) and of the ingress with the replicas up, a replica's against
the single server's, and the latency of one short request at a time (batch 1) against the single server.
The machine may be shared: compare the ratios of one run, not absolute times.

    .venv/bin/python bench/replicas.py [--prompts 32 --uses 8 --prefix-tokens 1000 --replicas 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from serve import start_server
from workloads import save


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, 40000) for _ in range(args.prefix_tokens)] for _ in range(args.prompts)]
    requests = [system + [rng.randrange(100, 40000) for _ in range(args.own_tokens)]
                for system in systems for _ in range(args.uses)]
    rng.shuffle(requests)
    return requests


def run(url: str, prompts: list[list[int]], concurrency: int) -> dict:
    def one(prompt):
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                              timeout=600)
        elapsed = time.perf_counter() - started
        response.raise_for_status()
        usage = response.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return elapsed, usage["prompt_tokens"], cached, response.headers.get("x-kvserve-replica", "single")

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    ttfts = [r[0] for r in results]
    prompt_tokens, cached = sum(r[1] for r in results), sum(r[2] for r in results)
    load = Counter(r[3] for r in results)
    return {"hit_rate": cached / prompt_tokens, "prefill_tokens": prompt_tokens - cached,
            "ttft_mean": statistics.mean(ttfts), "ttft_p90": float(np.percentile(ttfts, 90)),
            "per_replica": sorted(load.values(), reverse=True),
            "max_over_mean": max(load.values()) / (len(prompts) / len(load))}


def batch1(url: str, count: int, seed: int) -> float:
    rng = random.Random(seed)
    times = []
    for _ in range(count):
        prompt = [rng.randrange(100, 40000) for _ in range(16)]
        started = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).raise_for_status()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def ray_processes() -> dict[str, float]:
    """Resident MiB by kind: Ray's own processes, the ingress (it holds the tokenizer: for a GGUF model,
    the model), and the engine replicas."""
    memory = {"ray": 0.0, "ingress": 0.0, "replicas": []}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ServeReplica:kvserve:engine" in command:
            memory["replicas"].append(rss_mib(int(entry.name)))
        elif "ServeReplica:kvserve:ingress" in command:
            memory["ingress"] += rss_mib(int(entry.name))
        elif "ray::" in command or "/ray/" in command or "ray.util.client" in command:
            memory["ray"] += rss_mib(int(entry.name))
    return memory


def pool_bytes(blocks: int, block_size: int) -> int:
    from kvserve.kv.cache.kv_spec import kv_spec
    from kvserve.model.loader import load_model

    loaded = load_model(weights_dtype="auto")  # as the replicas load it: the KV dtype follows the weights
    return blocks * block_size * kv_spec(loaded.config, "auto", loaded.linear_dtype).bytes_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--uses", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--own-tokens", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch1", type=int, default=20, help="short requests timed one at a time")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prompts = workload(args)
    blocks_per_prompt = -(-(args.prefix_tokens + args.own_tokens + 1) // args.block_size)
    # A quarter of the system prompts per replica (with 4), plus room for its share of the requests in flight.
    in_flight = max(1, args.concurrency // args.replicas)
    replica_blocks = (args.prompts // args.replicas + in_flight) * blocks_per_prompt
    per_replica = pool_bytes(replica_blocks, args.block_size)
    print(f"W10: {args.prompts} system prompts x {args.prefix_tokens} tokens, {args.uses} uses each "
          f"({len(prompts)} requests, shuffled), concurrency {args.concurrency}; {args.replicas} replicas of "
          f"{replica_blocks} blocks ({per_replica / 2**20:.1f} MiB) each, single server {args.replicas} x that")
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores (shared machine: compare ratios)")
    results: dict[str, dict] = {}
    results.update(replicated(args, prompts, per_replica))
    process, url = start_server(["--kv-cache-memory", str(per_replica * args.replicas), "--block-size",
                                 str(args.block_size), "--speculative", "off"])
    try:
        base = url.removesuffix("/v1")
        results["single"] = run(base, prompts, args.concurrency)
        results["single"]["batch1_s"] = batch1(base, args.batch1, args.seed + 1)
        results["single"]["rss_mib"] = rss_mib(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)
    report(results, args)
    save("replicas", {"args": vars(args), "results": results})


def replicated(args, prompts, per_replica: int) -> dict[str, dict]:
    import ray
    from ray import serve

    from kvserve.config import EngineConfig
    from kvserve.replicas.app import APP_NAME, ReplicaOptions, start
    from kvserve.server.core.serving import ServerSettings

    config = EngineConfig(kv_cache_memory=per_replica, block_size=args.block_size, speculative="off")
    results = {}
    ray.init(address="local", namespace="kvserve-bench", log_to_driver=False, include_dashboard=False)
    try:
        for router in ("cache_aware", "round_robin"):
            port = _free_port()
            start(config, ServerSettings(model_name="bench"), ReplicaOptions(args.replicas, router), "127.0.0.1",
                  port)
            base = f"http://127.0.0.1:{port}"
            results[router] = run(base, prompts, args.concurrency)
            if router == "cache_aware":
                results[router]["batch1_s"] = batch1(base, args.batch1, args.seed + 1)
                results[router]["memory"] = ray_processes()
            serve.delete(APP_NAME)
            serve.shutdown()
    finally:
        ray.shutdown()
    return results


def report(results: dict[str, dict], args) -> None:
    print(f"\n{'setup':<12} {'hit rate':>8} {'prefill tok':>11} {'TTFT mean':>9} {'p90':>7} "
          f"{'max/mean':>8}  requests per replica")
    for name, r in results.items():
        print(f"{name:<12} {r['hit_rate']:>8.1%} {r['prefill_tokens']:>11,} {r['ttft_mean']:>8.2f}s "
              f"{r['ttft_p90']:>6.2f}s {r['max_over_mean']:>8.2f}  {r['per_replica']}")
    aware, robin, single = results["cache_aware"], results["round_robin"], results["single"]
    print(f"\ncache-aware hit rate / single server's: {aware['hit_rate'] / single['hit_rate']:.2f} (target >= 0.9)")
    print(f"prefill tokens, round-robin / cache-aware: {robin['prefill_tokens'] / max(aware['prefill_tokens'], 1):.2f}x "
          f"(target >= 3)")
    print(f"busiest replica / mean (cache-aware): {aware['max_over_mean']:.2f} (target <= 1.5)")
    memory = aware["memory"]
    print(f"\nRay's own processes: {memory['ray']:.0f} MiB resident with {args.replicas} replicas up, the ingress "
          f"{memory.get('ingress', 0):.0f} MiB; a replica "
          f"{statistics.mean(memory['replicas'] or [0]):.0f} MiB, the single server {single['rss_mib']:.0f} MiB")
    print(f"batch 1 (16-token prompt, 1 token): {aware['batch1_s'] * 1000:.1f} ms through Ray, "
          f"{single['batch1_s'] * 1000:.1f} ms single: +{(aware['batch1_s'] - single['batch1_s']) * 1000:.1f} ms "
          f"({aware['batch1_s'] / single['batch1_s']:.2f}x)")


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
