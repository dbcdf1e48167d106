"""W3 shared prefix: 32 x (same 1024-token prefix + 64 unique tokens, 32 output), prefix caching on vs off.

Reports wall time, mean TTFT, cached prompt tokens and peak KV blocks in use,
both ways in one run.

    .venv/bin/python bench/prefix.py [--requests 32 --prefix-len 1024 --suffix-len 64 --output-len 32]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from workloads import greedy, run_engine, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    prefix = rng.integers(1000, 40000, args.prefix_len).tolist()
    prompts = [prefix + rng.integers(1000, 40000, args.suffix_len).tolist() for _ in range(args.requests)]
    loaded = load_model()
    results = {}
    for caching in (True, False):
        engine = Engine(EngineConfig(kv_cache_memory="2GiB", enable_prefix_caching=caching), loaded=loaded)
        outputs, stats = run_engine(engine, prompts, greedy(args.output_len))
        block_bytes = engine.config.block_size * engine.kv_spec.bytes_per_token
        row = {
            "wall_s": stats["wall_s"],
            "mean_ttft_s": statistics.mean(o.metrics.ttft for o in outputs),
            "cached_tokens": sum(o.num_cached_tokens for o in outputs),
            "prompt_tokens": sum(len(p) for p in prompts),
            "peak_blocks": stats["peak_blocks"],
            "peak_kv_mib": stats["peak_blocks"] * block_bytes / 2**20,
        }
        results["on" if caching else "off"] = row
        print(f"prefix caching {'on ' if caching else 'off'}: wall {row['wall_s']:6.1f} s, mean TTFT {row['mean_ttft_s']:6.2f} s, "
              f"cached {row['cached_tokens']}/{row['prompt_tokens']} prompt tokens, "
              f"peak {row['peak_blocks']} blocks ({row['peak_kv_mib']:.0f} MiB)", flush=True)
    on, off = results["on"], results["off"]
    print(f"with caching: {off['wall_s'] / on['wall_s']:.1f}x faster wall time, "
          f"{off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x lower mean TTFT, "
          f"{off['peak_kv_mib'] / on['peak_kv_mib']:.1f}x less peak KV memory")
    print(f"wrote {save('prefix', {'workload': 'W3', 'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
