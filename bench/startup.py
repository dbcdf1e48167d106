"""Startup time (issue 42): seconds from `kvserve serve` to a 200 from /health, on the embedded model with
the kernels already built, over --runs starts; and what each start printed about the kernels (a start
that recompiles says so, and why).

    .venv/bin/python bench/startup.py [--runs 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from workloads import save


def one_start(extra: list[str]) -> dict:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", "0", *extra],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        while process.poll() is None:
            match = re.search(r"on (http://[\d.]+:\d+)/v1", Path(log.name).read_text())
            if match:
                try:
                    if httpx.get(match.group(1) + "/health", timeout=5).status_code == 200:
                        seconds = time.perf_counter() - started
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        else:
            raise SystemExit(f"the server exited:\n{Path(log.name).read_text()}")
    finally:
        process.terminate()
        process.wait(timeout=60)
    text = Path(log.name).read_text()
    kernel_lines = [line for line in text.splitlines() if "kernels" in line.lower()]
    return {"seconds_to_health": seconds, "compiled": any("compiling kvserve" in line for line in kernel_lines),
            "kernel_lines": kernel_lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    runs = [one_start(["--kv-cache-memory", args.kv_cache_memory]) for _ in range(args.runs)]
    for index, run in enumerate(runs, 1):
        print(f"start {index}: {run['seconds_to_health']:.2f} s to /health"
              f"{' (compiled the kernels)' if run['compiled'] else ''}")
        for line in run["kernel_lines"]:
            print(f"    {line}")
    seconds = [run["seconds_to_health"] for run in runs if not run["compiled"]]
    if seconds:
        print(f"kernels built: median {statistics.median(seconds):.2f} s to /health over {len(seconds)} starts")
    print(f"saved {save('startup', {'runs': runs})}")


if __name__ == "__main__":
    main()
