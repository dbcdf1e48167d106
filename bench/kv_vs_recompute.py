"""Time per generated token with a KV cache vs recomputing the whole sequence.

For each position P in 64, 128, ..., 2048 it measures the step that produces
the token after P tokens of context, exactly as `Generator` runs it:
  cached:    one forward of the single new token over a cache holding P tokens;
  recompute: one forward of all P+1 tokens (no cache), logits for the last.
Prints a table and writes JSON and a PNG plot to bench/results/.

    .venv/bin/python bench/kv_vs_recompute.py [--max-position 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.kv.cache import ContiguousKVCache
from kvserve.model.loader import load_model

RESULTS = Path(__file__).parent / "results"
LAST_ROW = torch.tensor([-1])


def positions_up_to(limit: int) -> list[int]:
    out, p = [], 64
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def time_cached_step(model, config, token_ids: list[int], position: int, repeats: int) -> float:
    cache = ContiguousKVCache(config, capacity=position + repeats)
    model(torch.tensor(token_ids[:position]), torch.arange(position), cache, LAST_ROW)  # prefill
    times = []
    for i in range(repeats):
        p = position + i
        started = time.perf_counter()
        model(torch.tensor([token_ids[p]]), torch.tensor([p]), cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_recompute_step(model, token_ids: list[int], position: int, repeats: int) -> float:
    ids = torch.tensor(token_ids[: position + 1])
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model(ids, torch.arange(position + 1), None, LAST_ROW)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max-position", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    loaded = load_model(args.model)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(1000, 40000, size=args.max_position + max(args.repeats, 5) + 1).tolist()
    model, config = loaded.model, loaded.config
    model(torch.tensor(token_ids[:64]), torch.arange(64), None, LAST_ROW)  # warm-up

    rows = []
    print(f"{'position':>8} {'cached ms/token':>16} {'recompute ms/token':>19} {'ratio':>7}")
    for position in positions_up_to(args.max_position):
        cached = time_cached_step(model, config, token_ids, position, max(args.repeats, 5))
        recompute = time_recompute_step(model, token_ids, position, args.repeats)
        rows.append({"position": position, "cached_ms": cached * 1e3, "recompute_ms": recompute * 1e3})
        print(f"{position:>8} {cached * 1e3:>16.1f} {recompute * 1e3:>19.1f} {recompute / cached:>6.1f}x", flush=True)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_vs_recompute.json").write_text(json.dumps({"model": loaded.source, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["position"] for r in rows]
    ax.plot(xs, [r["cached_ms"] for r in rows], "o-", label="KV cache (decode one token)")
    ax.plot(xs, [r["recompute_ms"] for r in rows], "s-", label="no cache (recompute sequence)")
    ax.set_xlabel("tokens of context")
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"Per-token time, {Path(loaded.source).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_vs_recompute.png", dpi=110)
    print(f"wrote {RESULTS / 'kv_vs_recompute.json'} and {RESULTS / 'kv_vs_recompute.png'}")


if __name__ == "__main__":
    main()
