"""One decode-attention layer over a paged cache: the torch path (gather the blocks, then split-KV /
union SDPA) against the C++ kernel that reads them in place, per cache dtype (--dtypes; int8 / int4 blocks
are widened by the kernel one at a time, the block being filled read from its float16 copy). SmolLM2's shape
(9 heads, 3 KV heads x 64, block 16); blocks scattered at random, as a long-running pool leaves them.
Milliseconds per call, every dtype in one run.

    .venv/bin/python bench/decode_attention.py [--dtypes float32 float16 int8 int4]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cpu_features import describe_cpu
from kvserve.kv.attention import CpuAttentionBackend, PagedKVContext, SequenceSlice, build_attention_metadata
from kvserve.kv.attention.cpu import slot_indices
from kvserve.kv.attention.cpu_decode import cpp_decode
from kvserve.kernels import ops
from kvserve.kv.cache.kv_spec import KVSpec
from workloads import save

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (context tokens, decoding requests, tokens of that context all requests share: a common prefix)
SHAPES = [(4096, 1, 0), (512, 1, 0), (300, 32, 0), (1040, 32, 1024)]


def time_ms(context: PagedKVContext, q: torch.Tensor, k: torch.Tensor, calls: int = 20) -> float:
    for _ in range(2):
        context.attend(0, q, k, k, HEAD_DIM**-0.5)
    started = time.perf_counter()
    for _ in range(calls):
        context.attend(0, q, k, k, HEAD_DIM**-0.5)
    return (time.perf_counter() - started) / calls * 1e3


ROUNDS = 5  # every dtype measured in turn, ROUNDS times; the fastest round counts (a shared machine's bursts)


def fill(cache, tables: list[list[int]], context_len: int) -> None:
    """Random K/V in every request's first `context_len` positions, written as the engine writes them."""
    positions = torch.arange(context_len)
    for table in tables:
        rows = slot_indices(torch.tensor(table)[positions // BLOCK], positions % BLOCK, KV_HEADS, BLOCK)
        cache.write(0, rows, torch.randn(context_len, KV_HEADS, HEAD_DIM), torch.randn(context_len, KV_HEADS, HEAD_DIM))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    args = parser.parse_args()
    kernel = cpp_decode
    if not ops.available():
        raise SystemExit("the C++ kernel could not be built here (see the log above); nothing to compare")
    print(f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads")
    rows = []
    for context_len, num_seqs, shared in SHAPES:
        setups = {dtype: setup(dtype, kernel, context_len, num_seqs, shared) for dtype in args.dtypes}
        best = {dtype: [float("inf"), float("inf")] for dtype in args.dtypes}
        for _ in range(ROUNDS):
            for dtype, (torch_path, in_place, q, k) in setups.items():
                best[dtype] = [min(best[dtype][0], time_ms(torch_path, q, k)), min(best[dtype][1], time_ms(in_place, q, k))]
        for dtype, (torch_ms, kernel_ms) in best.items():
            print(f"{dtype:>9} {num_seqs:>3} x {context_len:>5} tokens ({shared} shared): torch {torch_ms:.3f} ms, "
                  f"C++ kernel {kernel_ms:.3f} ms ({torch_ms / kernel_ms:.2f}x)", flush=True)
            rows.append({"dtype": dtype, "context": context_len, "requests": num_seqs, "shared_prefix": shared,
                         "torch_ms": torch_ms, "kernel_ms": kernel_ms})
    print(f"wrote {save('decode_attention', {'cpu': describe_cpu(), 'rows': rows})}")


def setup(dtype: str, kernel, context_len: int, num_seqs: int, shared: int):
    """One shape at one cache dtype: the torch path's context, the kernel's, and the step's new q, k."""
    blocks_each = context_len // BLOCK + 1
    shared_blocks = shared // BLOCK
    num_blocks = shared_blocks + num_seqs * (blocks_each - shared_blocks)
    cache = CpuAttentionBackend().allocate_kv_cache(KVSpec(1, KV_HEADS, HEAD_DIM, dtype), num_blocks, BLOCK,
                                                    max_num_seqs=num_seqs)
    cache.initialize_blocks_through(num_blocks - 1)
    free = torch.randperm(num_blocks).tolist()
    prefix = [free.pop() for _ in range(shared_blocks)]
    slices = [SequenceSlice((prefix + [free.pop() for _ in range(blocks_each - shared_blocks)],), context_len, 1)
              for _ in range(num_seqs)]
    fill(cache, [s.block_tables[0] for s in slices], context_len)
    meta = build_attention_metadata(slices, BLOCK)
    q, k = torch.randn(num_seqs, HEADS, HEAD_DIM), torch.randn(num_seqs, KV_HEADS, HEAD_DIM)
    in_place = build_attention_metadata(slices, BLOCK, union_factor=None)  # what the kernel reads
    return PagedKVContext(cache, [meta]), PagedKVContext(cache, [in_place], kernel), q, k


if __name__ == "__main__":
    main()
