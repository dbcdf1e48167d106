"""Batch-1 decode time per token (TPOT) by KV-cache dtype, in one sitting: steps interleaved across dtypes.

One engine per dtype (one model load shared), each with one request of --context prompt tokens, prefilled
first; then the engines take one decode step in turn, --steps times, so that every dtype meets the same
machine (a shared CPU's bursts land on all of them alike). Prints each dtype's median and fastest-quartile
step time, and their ratio to the first dtype's.

    .venv/bin/python bench/kv_decode_tpot.py [--dtypes float16 int4] [--context 4096] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from workloads import greedy, random_prompts, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "int4"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model()
    prompt = random_prompts(1, args.context)[0]
    engines = {}
    for dtype in args.dtypes:
        engine = Engine(EngineConfig(kv_cache_memory="1GiB", kv_cache_dtype=dtype, max_num_seqs=8), loaded=loaded)
        engine.add_request(prompt, greedy(args.steps + 8))
        running = engine.scheduler.running
        while not (running and running[0].num_tokens > len(prompt)):
            engine.step()  # the prefill, up to the first token
        engine.step()  # one decode step as warm-up
        engines[dtype] = engine
    times: dict[str, list[float]] = {dtype: [] for dtype in args.dtypes}
    for _ in range(args.steps):
        for dtype, engine in engines.items():
            started = time.perf_counter()
            engine.step()
            times[dtype].append((time.perf_counter() - started) * 1e3)
    print(f"CPU: {describe_cpu()}; batch 1, {args.context}-token prompt, {args.steps} decode steps per dtype, "
          f"interleaved")
    base = statistics.median(times[args.dtypes[0]])
    rows = []
    for dtype, values in times.items():
        values = sorted(values)
        median, quartile = statistics.median(values), values[len(values) // 4]
        rows.append({"dtype": dtype, "median_ms": median, "first_quartile_ms": quartile})
        print(f"{dtype:>9}: TPOT median {median:.2f} ms (fastest quarter {quartile:.2f} ms), "
              f"{median / base:.2f}x {args.dtypes[0]}", flush=True)
    print(f"saved {save('kv_decode_tpot', {'cpu': describe_cpu(), 'context': args.context, 'rows': rows})}")


if __name__ == "__main__":
    main()
