"""What each KV-cache dtype costs in speed, and what it buys in capacity.

For each dtype, on the embedded SmolLM2-135M-Instruct (one model load shared by
every engine): W1 (32 x 256 prompt, 128 output) output tok/s, W4 (1 x 4096
prompt, 64 output) TTFT and TPOT, and the tokens a 512 MiB pool holds.
float32 runs first and again last, so the table shows the machine's drift.

    .venv/bin/python bench/kv_quant_speed.py [--dtypes float32 int8 ...] [--workloads W1 W4]
"""

from __future__ import annotations

import argparse

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from workloads import greedy, random_prompts, run_engine, save

DTYPES = ["float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int8/int4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES)
    parser.add_argument("--workloads", nargs="+", default=["W1", "W4"], choices=["W1", "W4"])
    args = parser.parse_args()
    loaded = load_model()
    dtypes = ["float32"] + [d for d in args.dtypes if d != "float32"] + ["float32"]
    rows = []
    for dtype in dtypes:
        engine = Engine(EngineConfig(kv_cache_memory="2GiB", kv_cache_dtype=dtype), loaded=loaded)
        capacity = Engine(EngineConfig(kv_cache_memory="512MiB", kv_cache_dtype=dtype), loaded=loaded)
        row = {"dtype": engine.kv_spec.dtype, "bytes_per_token": engine.kv_spec.bytes_per_token,
               "tokens_in_512MiB": capacity.stats().num_blocks * capacity.config.block_size}
        del capacity
        run_engine(engine, random_prompts(2, 64, seed=1), greedy(4))  # warm-up
        if "W1" in args.workloads:
            outputs, stats = run_engine(engine, random_prompts(32, 256), greedy(128))
            row["w1_output_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / stats["wall_s"]
        if "W4" in args.workloads:
            (output,), _ = run_engine(engine, random_prompts(1, 4096), greedy(64))
            row["w4_ttft_s"], row["w4_tpot_ms"] = output.metrics.ttft, output.metrics.tpot * 1000
        rows.append(row)
        print("  ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                        for k, v in row.items()), flush=True)
        del engine

    base = rows[0]
    print("\n| dtype | bytes/token | tokens in 512 MiB | W1 out tok/s | vs float32 | W4 TTFT s | W4 TPOT ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r.get("w1_output_tok_s", 0) / base["w1_output_tok_s"] if "w1_output_tok_s" in base else 0
        print(f"| {r['dtype']} | {r['bytes_per_token']:,} | {r['tokens_in_512MiB']:,} | "
              f"{r.get('w1_output_tok_s', float('nan')):.1f} | {ratio:.2f}x | {r.get('w4_ttft_s', float('nan')):.2f} | "
              f"{r.get('w4_tpot_ms', float('nan')):.1f} |")
    print(f"saved {save('kv_quant_speed', {'rows': rows})}")


if __name__ == "__main__":
    main()
