"""The paged K/V tensors: per layer `[num_blocks, num_kv_heads, block_size, head_dim]`.

Allocated once with torch.empty, so pages are committed only as they are
used. Never-written memory may hold NaN/inf, and attention multiplies masked
rows of a partly filled block by a zero probability (0 x NaN = NaN), so every
block is zeroed before a step first uses it (`initialize_blocks_through`).
A token at position p of a request lives in block `table[p // block_size]`,
row `p % block_size`; its flat slot is `block_id * block_size + row`.
"""

from __future__ import annotations

import torch

from kvserve.kv.spec import KVSpec, torch_cache_dtype


class PagedKVCache:
    ZERO_CHUNK_BLOCKS = 64

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        dtype = torch_cache_dtype(spec.dtype)
        shape = (num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(spec.num_layers)]
        # Blocks [0, _zeroed_upto) have been zeroed. A fresh pool hands blocks
        # out in id order, so zeroing up to a high-water mark in contiguous
        # chunks costs one memset per chunk instead of per-block scatters.
        self._zeroed_upto = 0

    def initialize_blocks_through(self, highest_block_id: int) -> None:
        """Make sure every block up to `highest_block_id` has been zeroed once before first use."""
        top = highest_block_id + 1
        if top <= self._zeroed_upto:
            return
        end = min(self.num_blocks, max(top, self._zeroed_upto + self.ZERO_CHUNK_BLOCKS))
        for tensor in self.k + self.v:
            tensor[self._zeroed_upto : end].zero_()
        self._zeroed_upto = end

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slot_indices(self, slot_blocks: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        """Rows of the flat `[num_blocks * num_kv_heads * block_size, head_dim]` view for new tokens.

        `[T * num_kv_heads]`, token-major, computed once per step for all layers.
        """
        heads = torch.arange(self.spec.num_kv_heads)
        return ((slot_blocks[:, None] * self.spec.num_kv_heads + heads[None, :]) * self.block_size + slot_rows[:, None]).reshape(-1)

    def write(self, layer: int, slot_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at their slots (see `slot_indices`)."""
        head_dim = self.spec.head_dim
        k_flat, v_flat = self.k[layer].view(-1, head_dim), self.v[layer].view(-1, head_dim)
        # index_copy_ into a flat view: several times cheaper than advanced-index assignment.
        k_flat.index_copy_(0, slot_indices, k.reshape(-1, head_dim).to(k_flat.dtype))
        v_flat.index_copy_(0, slot_indices, v.reshape(-1, head_dim).to(v_flat.dtype))
