"""One decode-attention layer over a paged fp32 cache: the torch path (gather the blocks, then split-KV /
union SDPA) against the C++ kernel that reads them in place. SmolLM2's shape (9 heads, 3 KV heads x 64,
block 16); blocks scattered at random, as a long-running pool leaves them. Milliseconds per call.

    .venv/bin/python bench/decode_attention.py
"""

from __future__ import annotations

import time

import torch

from kvserve.cpu_features import describe_cpu
from kvserve.kv.attention import CpuAttentionBackend, PagedKVContext, SequenceSlice, build_attention_metadata
from kvserve.kernels import ops
from kvserve.kv.spec import KVSpec
from workloads import save

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (context tokens, decoding requests, tokens of that context all requests share: a common prefix)
SHAPES = [(4096, 1, 0), (512, 1, 0), (300, 32, 0), (1040, 32, 1024)]


def time_ms(context: PagedKVContext, q: torch.Tensor, k: torch.Tensor, calls: int = 30) -> float:
    for _ in range(3):
        context.attend(0, q, k, k, HEAD_DIM**-0.5)
    started = time.perf_counter()
    for _ in range(calls):
        context.attend(0, q, k, k, HEAD_DIM**-0.5)
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    kernel = ops.paged_decode
    if not ops.available():
        raise SystemExit("the C++ kernel could not be built here (see the log above); nothing to compare")
    print(f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads")
    rows = []
    for context_len, num_seqs, shared in SHAPES:
        blocks_each = context_len // BLOCK + 1
        shared_blocks = shared // BLOCK
        num_blocks = shared_blocks + num_seqs * (blocks_each - shared_blocks)
        cache = CpuAttentionBackend().allocate_kv_cache(KVSpec(1, KV_HEADS, HEAD_DIM, "float32"), num_blocks, BLOCK)
        cache.initialize_blocks_through(num_blocks - 1)
        for tensor in cache.k + cache.v:
            tensor.normal_()
        free = torch.randperm(num_blocks).tolist()
        prefix = [free.pop() for _ in range(shared_blocks)]
        slices = [SequenceSlice((prefix + [free.pop() for _ in range(blocks_each - shared_blocks)],), context_len, 1)
                  for _ in range(num_seqs)]
        meta = build_attention_metadata(slices, BLOCK)
        q, k = torch.randn(num_seqs, HEADS, HEAD_DIM), torch.randn(num_seqs, KV_HEADS, HEAD_DIM)
        torch_ms = time_ms(PagedKVContext(cache, [meta]), q, k)
        in_place = build_attention_metadata(slices, BLOCK, union_factor=None)  # what the kernel reads
        kernel_ms = time_ms(PagedKVContext(cache, [in_place], kernel), q, k)
        rows.append({"context": context_len, "requests": num_seqs, "shared_prefix": shared, "torch_ms": torch_ms,
                     "kernel_ms": kernel_ms})
        print(f"{num_seqs:>3} x {context_len:>5} tokens ({shared} shared): torch {torch_ms:.3f} ms, C++ kernel {kernel_ms:.3f} ms "
              f"({torch_ms / kernel_ms:.2f}x)", flush=True)
    print(f"wrote {save('decode_attention', {'cpu': describe_cpu(), 'rows': rows})}")


if __name__ == "__main__":
    main()
