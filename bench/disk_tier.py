"""W7 (DESIGN §5): the disk KV tier. Two tables, with the tier and without, in one run.

(1) Restart: a server warms a 1,024-token prefix (one request), is stopped
    (SIGTERM, graceful) and started again; the first request after the
    restart (same prefix, another question) is timed: TTFT with the tier vs
    without. With --drop-caches (root only) the page cache is dropped before
    the restart, so the tier is read from the disk itself, not from memory.
(2) Working set larger than the pool: --docs distinct 1,024-token documents,
    each asked about --questions times in shuffled order, one request at a
    time, with a pool that holds about --pool-docs of them: prefix-cache hit
    rate and mean TTFT with the tier vs without (in process, no HTTP).

Also per block: reading a block from the tier (read + checksum), writing it
into the pool, and recomputing it (prefill time per block of a 1,024-token
prompt), measured in process.

    .venv/bin/python bench/disk_tier.py [--docs 64] [--questions 4] [--pool-docs 16] [--drop-caches]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np

from serve import start_server
from workloads import greedy, random_prompts, save

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.model.loader import load_model

PREFIX = 1024
QUESTION = 16
OUTPUT = 8


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def stream_ttft(url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True, "stream": True}
    started, ttft = time.perf_counter(), None
    with httpx.stream("POST", url + "/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # read to the end: the request finishes before the server stops
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]" \
                    and json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft


@contextlib.contextmanager
def running_server(extra: list[str]) -> Iterator[str]:
    """A server for the block; stopped with SIGTERM (a graceful shutdown flushes the tier's writes)."""
    process, url = start_server(extra)
    try:
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def restart_table(disk: Path, drop_caches: bool) -> dict:
    prefix = random_prompts(1, PREFIX, seed=7)[0]
    first, second, third = random_prompts(3, QUESTION, seed=8)
    unrelated = random_prompts(1, 64, seed=9)[0]
    rows = {}
    for mode in ("without tier", "with tier"):
        shutil.rmtree(disk, ignore_errors=True)
        extra = ["--kv-disk-path", str(disk)] if mode == "with tier" else []
        with running_server(extra) as url:
            warm = stream_ttft(url, prefix + first)
        dropped = drop_caches and drop_page_cache()
        with running_server(extra) as url:
            after = stream_ttft(url, prefix + second)  # the new process's very first request
        with running_server(extra) as url:
            stream_ttft(url, unrelated)  # warms the process (first-call kernel setup) without touching the prefix
            after_warmup = stream_ttft(url, prefix + third)
        rows[mode] = {"warm_ttft_s": warm, "after_restart_ttft_s": after, "after_restart_warmed_ttft_s": after_warmup,
                      "page_cache_dropped": dropped}
    without, with_tier = rows["without tier"], rows["with tier"]
    rows["ratio_without_over_with"] = without["after_restart_ttft_s"] / with_tier["after_restart_ttft_s"]
    rows["ratio_warmed_without_over_with"] = without["after_restart_warmed_ttft_s"] / with_tier["after_restart_warmed_ttft_s"]
    return rows


def working_set_table(loaded, disk: Path, docs: int, questions: int, pool_docs: int) -> dict:
    """Both engines in one process, the same request on each in turn: machine noise hits both alike."""
    documents = random_prompts(docs, PREFIX, seed=11)
    asks = random_prompts(docs * questions, QUESTION, seed=12)
    order = np.random.default_rng(13).permutation([d for d in range(docs) for _ in range(questions)]).tolist()
    prompts = [documents[d] + asks[i] for i, d in enumerate(order)]
    shutil.rmtree(disk, ignore_errors=True)
    per_token = Engine(EngineConfig(kv_cache_memory=2**20), loaded=loaded).kv_spec.bytes_per_token
    memory = pool_docs * (PREFIX + QUESTION + OUTPUT) * per_token
    engines = {"without tier": Engine(EngineConfig(kv_cache_memory=memory), loaded=loaded),
               "with tier": Engine(EngineConfig(kv_cache_memory=memory, kv_disk_path=str(disk), kv_disk_size="64GiB"),
                                   loaded=loaded)}
    seen = {mode: {"ttfts": [], "cached": 0, "from_disk": 0, "wall_s": 0.0} for mode in engines}
    for prompt in prompts:
        for mode, engine in engines.items():
            started = time.perf_counter()
            engine.add_request(prompt, greedy(OUTPUT))
            assembler, final = RequestOutputAssembler(), None
            while engine.has_unfinished():
                for delta in engine.step():
                    final = assembler.add(delta) or final
            if engine.tiers is not None:
                engine.tiers.flush()  # one request at a time: its blocks are on disk before the next
            row = seen[mode]
            row["wall_s"] += time.perf_counter() - started
            row["ttfts"].append(final.metrics.ttft)
            row["cached"] += final.num_cached_tokens
            row["from_disk"] += final.prefix_cache.num_tier_cached_tokens
    queried = sum(len(p) for p in prompts)
    rows = {}
    for mode, engine in engines.items():
        row = seen[mode]
        rows[mode] = {"hit_rate": row["cached"] / queried, "tokens_from_disk": row["from_disk"],
                      "mean_ttft_s": float(np.mean(row["ttfts"])), "p50_ttft_s": float(np.median(row["ttfts"])),
                      "wall_s": row["wall_s"], "pool_blocks": engine.kv_manager.num_blocks,
                      "tier": None if engine.tiering is None else dataclasses.asdict(engine.tiering.stats())}
        engine.close()
    rows["mean_ttft_ratio_without_over_with"] = rows["without tier"]["mean_ttft_s"] / rows["with tier"]["mean_ttft_s"]
    return rows


def per_block_costs(loaded, disk: Path) -> dict:
    """Read + checksum, write into the pool, and recompute, per block of a 1,024-token prefix."""
    shutil.rmtree(disk, ignore_errors=True)
    prompt = random_prompts(1, PREFIX + 1, seed=21)[0]
    engine = Engine(EngineConfig(kv_cache_memory=256 * 2**20, kv_disk_path=str(disk)), loaded=loaded)
    started = time.perf_counter()
    engine.add_request(prompt, greedy(1))
    while engine.has_unfinished():
        engine.step()
    prefill_s = time.perf_counter() - started
    engine.close()
    num_blocks = PREFIX // engine.config.block_size
    fresh = Engine(EngineConfig(kv_cache_memory=256 * 2**20, kv_disk_path=str(disk)), loaded=loaded)
    tier, kv = fresh.tiers.named("disk"), fresh.kv_manager
    keys = kv.match_prefix(prompt, block_hashes(prompt, fresh.config.block_size)).tier.keys
    started = time.perf_counter()
    payloads = tier.load(keys)
    read_s = time.perf_counter() - started
    block_ids = list(range(len(payloads)))  # a throwaway engine: free blocks, written directly to time the copy
    started = time.perf_counter()
    fresh.kv_cache.write_blocks(block_ids, payloads)
    first_write_s = time.perf_counter() - started  # the pool's pages are touched for the first time
    started = time.perf_counter()
    fresh.kv_cache.write_blocks(block_ids, payloads)
    write_s = time.perf_counter() - started  # as in a running server, whose pool pages are committed
    fresh.close()
    return {"blocks": num_blocks, "block_bytes": fresh.kv_cache.block_nbytes,
            "read_ms_per_block": 1000 * read_s / len(payloads), "pool_write_ms_per_block": 1000 * write_s / len(payloads),
            "pool_first_write_ms_per_block": 1000 * first_write_s / len(payloads),
            "recompute_ms_per_block": 1000 * prefill_s / num_blocks,
            "recompute_over_load": prefill_s / (read_s + write_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--pool-docs", type=int, default=16)
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each restart (root)")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--skip-working-set", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvserve-tier-bench-"))
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; tier directory {work}")
    loaded = load_model()
    result: dict = {"cpu": cpu_model()}
    costs = per_block_costs(loaded, work / "per-block")
    result["per_block"] = costs
    print(f"\nper block ({costs['block_bytes'] / 2**10:.0f} KiB, {loaded.config.num_layers} layers): read+checksum "
          f"{costs['read_ms_per_block']:.3f} ms, write into pool {costs['pool_write_ms_per_block']:.3f} ms "
          f"({costs['pool_first_write_ms_per_block']:.3f} ms on never-touched pool pages), "
          f"recompute {costs['recompute_ms_per_block']:.2f} ms -> loading is {costs['recompute_over_load']:.0f}x cheaper")
    if not args.skip_restart:
        rows = restart_table(work / "restart", args.drop_caches)
        result["restart"] = rows
        print(f"\n(1) restart, {PREFIX}-token prefix + {QUESTION}-token question, {OUTPUT} output tokens")
        print(f"{'':>14} {'TTFT before':>12} {'after restart: 1st request':>27} {'after an unrelated warm-up':>27}")
        for mode in ("without tier", "with tier"):
            row = rows[mode]
            cold = " (page cache dropped)" if row["page_cache_dropped"] else ""
            print(f"{mode:>14} {row['warm_ttft_s']:>11.3f}s {row['after_restart_ttft_s']:>26.3f}s "
                  f"{row['after_restart_warmed_ttft_s']:>26.3f}s{cold}")
        print(f"after a restart, TTFT with the tier is {rows['ratio_without_over_with']:.1f}x lower (first request), "
              f"{rows['ratio_warmed_without_over_with']:.1f}x lower (warmed process)")
    if not args.skip_working_set:
        rows = working_set_table(loaded, work / "working-set", args.docs, args.questions, args.pool_docs)
        result["working_set"] = rows
        print(f"\n(2) {args.docs} documents x {args.questions} questions, shuffled, pool of ~{args.pool_docs} documents")
        print(f"{'':>14} {'hit rate':>9} {'from disk':>10} {'mean TTFT':>10} {'p50 TTFT':>9} {'wall':>8}")
        for mode in ("without tier", "with tier"):
            row = rows[mode]
            print(f"{mode:>14} {row['hit_rate']:>8.1%} {row['tokens_from_disk']:>10,} {row['mean_ttft_s']:>9.3f}s "
                  f"{row['p50_ttft_s']:>8.3f}s {row['wall_s']:>7.1f}s")
        print(f"mean TTFT {rows['mean_ttft_ratio_without_over_with']:.1f}x lower with the tier")
    print(f"\nsaved {save('disk_tier', result)}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
