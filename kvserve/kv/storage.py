"""The paged K/V tensors: per layer `[num_blocks, num_kv_heads, block_size, head_dim]`.

Allocated once with torch.empty, so pages are committed only as they are
used. Never-written memory may hold NaN/inf, and attention multiplies masked
rows of a partly filled block by a zero probability (0 x NaN = NaN), so every
block is zeroed the first time a step uses it (`initialize_blocks`).
A token at position p of a request lives in block `table[p // block_size]`,
row `p % block_size`; its flat slot is `block_id * block_size + row`.
"""

from __future__ import annotations

import torch

from kvserve.kv.spec import KVSpec, torch_cache_dtype


class PagedKVCache:
    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        dtype = torch_cache_dtype(spec.dtype)
        shape = (num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self._uninitialized = torch.ones(num_blocks, dtype=torch.bool)

    def initialize_blocks(self, block_ids: torch.Tensor) -> None:
        """Zero those of `block_ids` never used before (once per block, ever)."""
        fresh = block_ids[self._uninitialized[block_ids]]
        if fresh.numel():
            for tensor in self.k + self.v:
                tensor[fresh] = 0
            self._uninitialized[fresh] = False

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot_blocks: torch.Tensor, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at their slots."""
        self.k[layer][slot_blocks, :, slot_rows] = k.to(self.k[layer].dtype)
        self.v[layer][slot_blocks, :, slot_rows] = v.to(self.v[layer].dtype)
