"""Time per generated token with a KV cache vs recomputing the whole sequence.

For each context length P in 64, 128, ..., 2048 it runs one request with a
P-token prompt through the engine twice: with the KV cache (each step computes
one new token) and with `enable_kv_cache=False` (each step recomputes all P+i
tokens). It reports the mean time per output token after the first (TPOT).
Prints a table and writes JSON and a PNG plot to bench/results/.

    .venv/bin/python bench/kv_vs_recompute.py [--max-position 2048] [--tokens 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.loader import load_model

RESULTS = Path(__file__).parent / "results"


def tpot(engine: Engine, prompt: list[int], num_tokens: int) -> float:
    engine.add_request(prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    assembler, final = RequestOutputAssembler(), None
    while engine.has_unfinished():
        for delta in engine.step():
            final = assembler.add(delta) or final
    return final.metrics.tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max-position", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4, help="output tokens per measurement (TPOT over tokens 2..N)")
    args = parser.parse_args()

    loaded = load_model(args.model)
    memory = 2 * (args.max_position + 64) * 46_080 + 2**24
    cached = Engine(EngineConfig(kv_cache_memory=memory), loaded=loaded)
    recompute = Engine(EngineConfig(kv_cache_memory=memory, enable_kv_cache=False), loaded=loaded)
    rng = np.random.default_rng(0)
    positions = [64 * 2**i for i in range(16) if 64 * 2**i <= args.max_position]
    tpot(cached, rng.integers(1000, 40000, 64).tolist(), 3)  # warm-up

    rows = []
    print(f"{'context':>8} {'cached ms/token':>16} {'recompute ms/token':>19} {'ratio':>7}")
    for position in positions:
        prompt = rng.integers(1000, 40000, position).tolist()
        with_cache = tpot(cached, prompt, max(args.tokens, 8))
        without = tpot(recompute, prompt, args.tokens)
        rows.append({"context": position, "cached_ms": with_cache * 1e3, "recompute_ms": without * 1e3})
        print(f"{position:>8} {with_cache * 1e3:>16.1f} {without * 1e3:>19.1f} {without / with_cache:>6.1f}x", flush=True)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_vs_recompute.json").write_text(json.dumps({"model": loaded.source, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["context"] for r in rows]
    ax.plot(xs, [r["cached_ms"] for r in rows], "o-", label="KV cache (compute one new token)")
    ax.plot(xs, [r["recompute_ms"] for r in rows], "s-", label="no cache (recompute the sequence)")
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
