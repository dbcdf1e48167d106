"""TTFT when the KV pool's pages are first touched by a request's step, against zeroed ahead while the server idles.

A server on the embedded model (AsyncEngine, its steps on the compute thread) waits `--idle` seconds after
start, then takes `--requests` requests one after another (each a fresh `--prompt`-token random prompt, one
output token, `--gap` seconds apart: a user's pace, not a flood), so their prefills walk through fresh blocks
and, past each huge page's worth of blocks, into fresh pages of every layer's tensor (kv/cache/zeroing.py).
Each setting runs in its own process (a pool reuses no page an earlier pool in the process touched), the two
alternating for `--rounds` rounds. Prints the first request's TTFT, the median and the slowest of the rest.

    .venv/bin/python bench/pool_zeroing.py [--rounds 2] [--requests 16] [--prompt 512] [--idle 2] [--gap 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from kvserve.platform import compute_executor
from workloads import freeze_setup, greedy, random_prompts, save

SETTINGS = {"steps zero": False, "zeroed ahead while idle": True}


async def serve(engine: Engine, zero_ahead: bool, args: argparse.Namespace) -> list[float]:
    """Each request's TTFT (seconds) on a server that started `args.idle` seconds before the first."""
    server = AsyncEngine(engine, zero_pool_ahead=zero_ahead)
    await server.start()
    await asyncio.sleep(args.idle)
    ttfts = []
    for i, prompt in enumerate(random_prompts(args.requests, args.prompt, seed=11)):
        started = time.perf_counter()
        async for _ in server.generate(prompt, greedy(1), f"r{i}"):
            ttfts.append(time.perf_counter() - started)
            break
        await asyncio.sleep(args.gap)
    await server.stop()
    return ttfts


def one_setting(name: str, args: argparse.Namespace) -> list[float]:
    """In this process: load the model and build the engine on the compute thread (as the server does)."""
    def build() -> Engine:
        loaded = load_model(weights_dtype="auto")
        return Engine(EngineConfig(speculative="off"), loaded=loaded)

    engine = compute_executor().submit(build).result()
    freeze_setup()
    return asyncio.run(serve(engine, SETTINGS[name], args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--idle", type=float, default=2.0,
                        help="seconds between the server's start and the first request")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between one request's first token and the next")
    parser.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)  # a child process's one setting
    args = parser.parse_args()
    if args.setting is not None:
        print(json.dumps(one_setting(args.setting, args)))
        return
    print(f"CPU: {describe_cpu()}", flush=True)
    passed = [f"--requests={args.requests}", f"--prompt={args.prompt}", f"--idle={args.idle}", f"--gap={args.gap}"]
    results: dict[str, list[list[float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name in SETTINGS:
            child = subprocess.run([sys.executable, __file__, f"--setting={name}", *passed], check=True,
                                   capture_output=True, text=True)
            ttfts = json.loads(child.stdout.strip().splitlines()[-1])
            results[name].append(ttfts)
            rest = ttfts[1:]
            print(f"{name:24s} first request TTFT {ttfts[0] * 1e3:6.0f} ms; the other {len(rest)}: median "
                  f"{statistics.median(rest) * 1e3:5.0f} ms, slowest {max(rest) * 1e3:5.0f} ms", flush=True)
    print(f"wrote {save('pool_zeroing', {'args': vars(args), 'ttft_s': results})}")


if __name__ == "__main__":
    main()
