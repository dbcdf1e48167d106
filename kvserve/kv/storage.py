"""The paged K/V tensors: per layer `[num_blocks, num_kv_heads, block_size, head_dim]`.

Quantized dtypes store their elements in the same layout (int4 packed, so the
last dimension is head_dim / 2) plus per-row parameters (scales, minimums)
in `[num_blocks, num_kv_heads, block_size, num_params]` tensors indexed by the
same block ids. K/V are encoded on write and decoded only when attention
gathers the blocks it reads (`gather`).

Allocated once with torch.empty, so pages are committed only as they are
used. Never-written memory may hold NaN/inf, and attention multiplies masked
rows of a partly filled block by a zero probability (0 x NaN = NaN), so every
block is zeroed before a step first uses it (`initialize_blocks_through`).
A token at position p of a request lives in block `table[p // block_size]`,
row `p % block_size`; its flat slot is `block_id * block_size + row`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.quant import PARAM_DTYPE
from kvserve.kv.spec import KVSpec


@dataclass
class GatheredKV:
    """Some blocks of one layer, read for attention: `[NB, num_kv_heads, block_size, head_dim]` each.

    With `k_scale`/`v_scale` (`[NB, num_kv_heads, block_size]`), `k`/`v` are
    not yet scaled: attention multiplies the scores by `k_scale` and the
    probabilities by `v_scale`, which is cheaper than rescaling every element.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class PagedKVCache:
    ZERO_CHUNK_BLOCKS = 64

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int) -> None:
        self.spec = spec
        self.codec = codec = spec.codec
        self.num_blocks = num_blocks
        self.block_size = block_size
        data_shape = (num_blocks, spec.num_kv_heads, block_size, codec.data_width(spec.head_dim))
        # fp8 is held as raw bytes: CPU torch has no index_copy_/index_select for
        # float8 types, and the bits are the same either way.
        self._raw_fp8 = codec.storage_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        container = torch.uint8 if self._raw_fp8 else codec.storage_dtype
        self.k = [torch.empty(data_shape, dtype=container) for _ in range(spec.num_layers)]
        self.v = [torch.empty(data_shape, dtype=container) for _ in range(spec.num_layers)]
        # Quantization parameters live beside their blocks, indexed by the same block id.
        num_params = codec.num_params(spec.head_dim)
        params_shape = (num_blocks, spec.num_kv_heads, block_size, num_params)
        self.k_params = [torch.empty(params_shape, dtype=PARAM_DTYPE) for _ in range(spec.num_layers)] \
            if num_params else []
        self.v_params = [torch.empty(params_shape, dtype=PARAM_DTYPE) for _ in range(spec.num_layers)] \
            if num_params else []
        # Blocks [0, _zeroed_upto) have been zeroed. A fresh pool hands blocks
        # out in id order, so zeroing up to a high-water mark in contiguous
        # chunks costs one memset per chunk instead of per-block scatters.
        self._zeroed_upto = 0

    def _tensors(self) -> list[torch.Tensor]:
        return self.k + self.v + self.k_params + self.v_params

    def initialize_blocks_through(self, highest_block_id: int) -> None:
        """Make sure every block up to `highest_block_id` has been zeroed once before first use."""
        top = highest_block_id + 1
        if top <= self._zeroed_upto:
            return
        end = min(self.num_blocks, max(top, self._zeroed_upto + self.ZERO_CHUNK_BLOCKS))
        for tensor in self._tensors():
            tensor[self._zeroed_upto : end].zero_()
        self._zeroed_upto = end

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def slot_indices(self, slot_blocks: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        """Rows of the flat `[num_blocks * num_kv_heads * block_size, width]` views for new tokens.

        `[T * num_kv_heads]`, token-major, computed once per step for all layers.
        """
        heads = torch.arange(self.spec.num_kv_heads)
        return ((slot_blocks[:, None] * self.spec.num_kv_heads + heads[None, :]) * self.block_size + slot_rows[:, None]).reshape(-1)

    def write(self, layer: int, slot_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store (encode) new tokens' K/V `[T, num_kv_heads, head_dim]` at their slots (see `slot_indices`)."""
        head_dim = self.spec.head_dim
        for cache, params, x in ((self.k, self.k_params, k), (self.v, self.v_params, v)):
            data, row_params = self.codec.encode(x.reshape(-1, head_dim))
            if self._raw_fp8:
                data = data.view(torch.uint8)
            flat = cache[layer].view(-1, data.shape[-1])
            # index_copy_ into a flat view: several times cheaper than advanced-index assignment.
            flat.index_copy_(0, slot_indices, data)
            if row_params is not None:
                params[layer].view(-1, row_params.shape[-1]).index_copy_(0, slot_indices, row_params)

    def gather(self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype, fold_scales: bool = False) -> GatheredKV:
        """Blocks `block_ids` of `layer` in `dtype`; scales left to the caller when `fold_scales` and the codec has them."""
        k = self.k[layer].index_select(0, block_ids)  # index_select: 3x faster than []
        v = self.v[layer].index_select(0, block_ids)
        if self._raw_fp8:
            k, v = k.view(self.codec.storage_dtype), v.view(self.codec.storage_dtype)
        if not self.k_params:
            return GatheredKV(k.to(dtype), v.to(dtype))
        k_params = self.k_params[layer].index_select(0, block_ids)
        v_params = self.v_params[layer].index_select(0, block_ids)
        if fold_scales and self.codec.folds_scale:
            return GatheredKV(k.to(dtype), v.to(dtype), k_params[..., 0].to(dtype), v_params[..., 0].to(dtype))
        return GatheredKV(self.codec.decode(k, k_params, dtype), self.codec.decode(v, v_params, dtype))
