"""What the lab's kept-tokens record costs the engine (issue 43): one compacted chunk with and without it.

The record is made on the engine's thread right after a chunk is compacted (runner.begin_step): the kept indices
`compact_chunk` already returns, stacked into one int16 CPU array and kept in a dict. Nothing is recorded until
the lab's /lab/kept page (or /lab/api/kept) is first opened; from then on every compaction pays this. This times,
on a real model's cache shape (default SmolLM2-135M: 30 layers x 3 KV heads x 64, a 512-token chunk at 2x):
compact_chunk alone, compact_chunk + the record, and the record alone (kept_record + KeptTokens.record), rounds
alternating in one sitting; plus what the lab's endpoint spends turning a chunk into its bitmasks (off the
engine's thread) and the bytes a record holds. Prints medians and ratios; never asserts.

    .venv/bin/python bench/kept_tokens_cost.py [--model SmolLM2-135M] [--kv-dtype float16] [--ratio 2] [--rounds 41]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.observe.kept_tokens import KeptTokens
from kvserve.kv.attention import CpuAttentionBackend
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.compressed_chunks import Compaction
from kvserve.kv.compression.compact import chunk_slots, compact_chunk, kept_record
from kvserve.kv.compression.engine_spec import engine_spec
from kvserve.model.catalog import find_known_model
from kvserve.server.lab.kept import kept_json

BS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M")
    parser.add_argument("--kv-dtype", default="float16")
    parser.add_argument("--method", default="knorm")
    parser.add_argument("--ratio", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    config = find_known_model(args.model)
    spec = engine_spec(f"{args.method}:{args.ratio:g}", BS)
    backend = CpuAttentionBackend()
    blocks_per_chunk = spec.chunk // BS
    cache = backend.allocate_kv_cache(kv_spec(config, args.kv_dtype), num_blocks=blocks_per_chunk + 1, block_size=BS,
                                      max_num_seqs=1)
    cache.initialize_blocks_through(blocks_per_chunk)
    blocks = list(range(1, blocks_per_chunk + 1))
    slots = chunk_slots(backend, cache, blocks, spec.chunk).reshape(-1)
    gen = torch.Generator().manual_seed(0)
    heads, dim = cache.spec.num_kv_heads, cache.spec.head_dim
    for layer in range(cache.spec.num_layers):
        cache.write(layer, slots, torch.randn(spec.chunk, heads, dim, generator=gen),
                    torch.randn(spec.chunk, heads, dim, generator=gen))
    compaction = Compaction(1, spec.chunk, tuple(blocks), spec.chunk_budget(BS) // BS)  # chunk 1: no sinks
    store = KeptTokens()
    store.enable()
    store.start("r", 2 * spec.chunk, 1)

    def plain() -> None:
        compact_chunk(backend, cache, compaction, spec)

    def recorded() -> None:
        kept = compact_chunk(backend, cache, compaction, spec)
        store.record("r", compaction.chunk_index, compaction.first_position, kept_record(kept), spec.chunk,
                     tuple(range(cache.spec.num_layers)))

    kept = compact_chunk(backend, cache, compaction, spec)

    def record_only() -> None:
        store.record("r", compaction.chunk_index, compaction.first_position, kept_record(kept), spec.chunk,
                     tuple(range(cache.spec.num_layers)))

    def to_json() -> None:
        kept_json(store.get("r"))

    times: dict[str, list[float]] = {"compact": [], "compact+record": [], "record": [], "endpoint json": []}
    for _ in range(3):  # warm-up
        plain(), recorded(), record_only(), to_json()
    for _ in range(args.rounds):
        for name, fn in (("compact", plain), ("compact+record", recorded), ("record", record_only),
                         ("endpoint json", to_json)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.model} ({cache.spec.num_layers} layers x {heads} KV heads x {dim}), KV {args.kv_dtype}, "
          f"{args.method}:{args.ratio:g}: one {spec.chunk}-token chunk keeping {spec.chunk_budget(BS)}, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}")
    for name, value in median.items():
        print(f"  {name:<16} median {value * 1e3:8.3f} ms")
    print(f"  record / compact: {100 * median['record'] / median['compact']:.4f}%; "
          f"(compact+record) / compact: {median['compact+record'] / median['compact']:.3f}")
    held = store.num_bytes
    print(f"  a record holds {held:,} bytes per chunk (int16 [layers, KVH, budget]); the kept K/V it describes: "
          f"{cache.spec.num_layers * heads * spec.chunk_budget(BS) * 2 * dim * cache.keys.data[0].element_size():,} "
          f"bytes")


if __name__ == "__main__":
    main()
