"""The paged K/V tensors: per layer, one tensor for K and one for V, in the attention backend's layout.

With KV groups (kv/groups/layout.py) a block id names a page of one group: layers
of different groups in the same slot share one tensor, each reading it at its
own group's page ids.

The backend chooses the shape (`AttentionBackend.kv_cache_shape`; the cpu
backend's is `[num_blocks, num_kv_heads, block_size, head_dim]`) with the
block first and the row width last. Quantized dtypes store their elements in
the same layout (int4 packed, so the last dimension is head_dim / 2) plus
per-row parameters (scales, minimums) in tensors of the same layout whose
last dimension is the number of parameters, indexed by the same block ids.
K/V are encoded on write and decoded only when attention gathers the blocks
it reads (`gather`). A blockwise codec (int4 keys, per channel over a block)
encodes a block only once it is full: until then the block's K and V are kept
in float16 beside the pool (kv/cache/open_blocks.py), and every reader here takes
an open block's rows from there.

Allocated once, uninitialized, on the pool's device (EngineConfig.device; on the
CPU on huge pages where the OS has them), so pages are committed only as they
are used; every tensor built here is built there. Never-written memory may hold
NaN/inf, and attention multiplies masked rows of a partly filled block by a zero
probability (0 x NaN = NaN), so every block is zeroed before a step first uses
it (`initialize_blocks_through`), or before that while the server idles (`zero_ahead`:
kv/cache/zeroing.py says why).
A token at position p of a request lives in block `table[p // block_size]`,
row `p % block_size`; which flat row of a layer's tensor that is depends on
the layout, so the backend computes the slots it writes to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvserve import huge_pages
from kvserve.kernels import ops
from kvserve.kv.cache.open_blocks import OpenBlocks
from kvserve.kv.cache.zeroing import BlockZeroing, blocks_per_page
from kvserve.kv.cache.quant import PARAM_DTYPE, KVCodec
from kvserve.kv.cache.kv_spec import KVSpec

# Requests whose open blocks a pool keeps room for when its caller does not say (EngineConfig.max_num_seqs' default).
DEFAULT_OPEN_REQUESTS = 64

# (num_blocks, num_kv_heads, block_size, row_width) -> the shape of one layer's tensor.
LayerShape = Callable[[int, int, int, int], tuple[int, ...]]


@dataclass
class GatheredKV:
    """Some blocks of one layer, read for attention, in the cache's layout (cpu: `[NB, num_kv_heads,
    block_size, head_dim]` each).

    With `k_scale`/`v_scale` (that layout without the last dimension), `k`/`v` are
    not yet scaled: attention multiplies the scores by `k_scale` and the
    probabilities by `v_scale`, which is cheaper than rescaling every element.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class _PagedSide:
    """One side of the pool (K or V): per layer, elements (row width: the codec's data width) and
    parameters (row width: the codec's parameter count; absent for float codecs)."""

    def __init__(self, codec: KVCodec, spec: KVSpec, num_blocks: int, block_size: int, layer_shape: LayerShape,
                 device: torch.device) -> None:
        self.codec = codec
        # fp8 is held as raw bytes: CPU torch has no index_copy_/index_select for
        # float8 types, and the bits are the same either way.
        self.raw_fp8 = codec.is_fp8
        container = torch.uint8 if self.raw_fp8 else codec.storage_dtype
        shape = layer_shape(num_blocks, spec.num_kv_heads, block_size, codec.data_width(spec.head_dim))
        # One tensor per slot of a page (kv/groups/layout.py); layer i addresses its slot's tensor with the page
        # ids of its own group. A model of one kind has one slot per layer.
        layout = spec.layout
        # On huge pages where the OS has them (kvserve/huge_pages.py): every decode step reads the blocks again.
        self.slot_data = [huge_pages.empty(shape, container, device) for _ in range(layout.page_layers)]
        num_params = codec.num_params(spec.head_dim, block_size)
        params_shape = layer_shape(num_blocks, spec.num_kv_heads, block_size, num_params)
        self.block_size = block_size
        self.slot_params = [huge_pages.empty(params_shape, PARAM_DTYPE, device)
                            for _ in range(layout.page_layers)] if num_params else []
        self.data = [self.slot_data[slot] for slot in layout.layer_slot]
        self.params = [self.slot_params[slot] for slot in layout.layer_slot] if num_params else []

    def write(self, layer: int, slot_indices: torch.Tensor, x: torch.Tensor) -> None:
        data, params = self.codec.encode(x)
        if self.raw_fp8:
            data = data.view(torch.uint8)
        # index_copy_ into a flat view: several times cheaper than advanced-index assignment.
        self.data[layer].view(-1, data.shape[-1]).index_copy_(0, slot_indices, data)
        if params is not None:
            self.params[layer].view(-1, params.shape[-1]).index_copy_(0, slot_indices, params)

    def read_rows(self, layer: int, slot_indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Flat rows `slot_indices` of `layer`, decoded to `dtype`: `[rows, head_dim]`."""
        data = self.data[layer].view(-1, self.data[layer].shape[-1]).index_select(0, slot_indices)
        if self.raw_fp8:
            data = data.view(self.codec.storage_dtype)
        params = None
        if self.codec.blockwise:  # each row with its (block, head)'s parameters: rows are (block, head)-major
            width = self.params[layer].shape[-1] * self.block_size
            block_heads = torch.div(slot_indices, self.block_size, rounding_mode="floor")
            return self.codec.decode_rows(data, self.params[layer].view(-1, width).index_select(0, block_heads), dtype)
        if self.params:
            params = self.params[layer].view(-1, self.params[layer].shape[-1]).index_select(0, slot_indices)
        return self.codec.decode(data, params, dtype)

    def store_blocks(self, slot: int, block_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Whole blocks `[n, num_kv_heads, block_size, head_dim]` of storage tensor `slot`, encoded."""
        data, params = self.codec.encode_blocks(x)
        self.slot_data[slot].index_copy_(0, block_ids, data.view(torch.uint8) if self.raw_fp8 else data)
        if params is not None:
            self.slot_params[slot].index_copy_(0, block_ids, params)

    def load_blocks(self, slot: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks of storage tensor `slot`, decoded to float32."""
        data = self.slot_data[slot].index_select(0, block_ids)
        if self.raw_fp8:
            data = data.view(self.codec.storage_dtype)
        params = self.slot_params[slot].index_select(0, block_ids) if self.slot_params else None
        return self.codec.decode_blocks(data, params, torch.float32)

    def read(self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype,
             fold_scales: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        data = self.data[layer].index_select(0, block_ids)  # index_select: 3x faster than []
        if self.raw_fp8:
            data = data.view(self.codec.storage_dtype)
        if not self.params:
            return data.to(dtype), None
        params = self.params[layer].index_select(0, block_ids)
        if fold_scales and self.codec.folds_scale:
            return self.codec.elements(data, dtype), params[..., 0].to(dtype)
        return self.codec.decode_blocks(data, params, dtype), None


class PagedKVCache:
    """The pool on `device`; `layer_shape` is the attention backend's layout (`AttentionBackend.allocate_kv_cache`).
    `use_cpp_kernels=False` keeps every write in torch (the `cpu-torch` backend runs no C++)."""

    ZERO_CHUNK_BLOCKS = 64

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, layer_shape: LayerShape,
                 device: str | torch.device = "cpu", use_cpp_kernels: bool = True,
                 max_num_seqs: int | None = None) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.keys = _PagedSide(spec.k_codec, spec, num_blocks, block_size, layer_shape, self.device)
        self.values = _PagedSide(spec.v_codec, spec, num_blocks, block_size, layer_shape, self.device)
        self.k, self.v = self.keys.data, self.values.data
        self.k_params, self.v_params = self.keys.params, self.values.params
        # Blocks still being filled, in float16, while a blockwise codec waits for them to be full: room for
        # one per request of a full batch (`max_num_seqs`) and KV group, never more than there are blocks.
        self.open_blocks: OpenBlocks | None = None
        if spec.has_open_blocks:
            if layer_shape(2, 3, 5, 7) != (2, 3, 5, 7):
                raise ValueError("blockwise KV codecs need the [block, KV head, row, width] layout")
            slots = min(spec.open_slots(max_num_seqs or DEFAULT_OPEN_REQUESTS), num_blocks)
            self.open_blocks = OpenBlocks(self, spec.layout.page_layers, slots, num_blocks, spec.num_kv_heads,
                                          block_size, spec.head_dim, self.device, use_cpp_kernels)
        # Plain float rows on both sides (no parameters, no fp8 bytes, one dtype): the one-pass C++ store.
        self.one_pass_store = (use_cpp_kernels and spec.k_codec.kind == "float" and spec.v_codec.kind == "float"
                               and self.k[0].dtype == self.v[0].dtype and self.k[0].dtype in ops.CACHE_DTYPES)
        # A fresh pool hands blocks out in id order, so zeroing up to a high-water mark in contiguous chunks
        # costs one memset per chunk instead of per-block scatters; ahead of it, a huge page's worth of blocks.
        tensors = self._tensors()
        self.zeroing = BlockZeroing(tensors, num_blocks, self.ZERO_CHUNK_BLOCKS,
                                    blocks_per_page(tensors, self.ZERO_CHUNK_BLOCKS))

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool once (layers of different groups share their slot's tensor)."""
        return self.keys.slot_data + self.values.slot_data + self.keys.slot_params + self.values.slot_params

    def initialize_blocks_through(self, highest_block_id: int) -> None:
        """Make sure every block up to `highest_block_id` has been zeroed once before first use."""
        self.zeroing.through(highest_block_id)

    def zero_ahead(self, whole_pool: bool = False) -> bool:
        """Zero one piece of the blocks past those steps have used (one tensor's, milliseconds), so that a later
        step does not fault their pages in: up to the pool's end, or a huge page's worth past the used blocks;
        whether more is left. Between steps only."""
        return self.zeroing.ahead(whole_pool)

    def block_layout(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Shape and dtype of one block's slice of every tensor of the pool, in `read_blocks` order."""
        return tuple((tuple(t.shape[1:]), t.dtype) for t in self._tensors())

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (page) across its group's layers, K and V, data and parameters."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    def read_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """Each block's bytes in every tensor of the pool: views of one copy (the blocks may be reused
        after), in `block_layout` order."""
        if self.open_blocks is not None:  # a block leaves whole only as the pool holds it
            self.open_blocks.close(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [t.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8) for t in self._tensors()]
        rows = torch.cat(parts, dim=1).cpu().numpy()  # host bytes (`.cpu()` is the tensor itself on the CPU)
        return [memoryview(row) for row in rows]

    def write_blocks(self, block_ids: list[int], payloads: Sequence[bytes | memoryview]) -> None:
        """Put `read_blocks`' bytes back into blocks `block_ids` (their rows become those K/V)."""
        if not block_ids:
            return
        if any(len(p) != self.block_nbytes for p in payloads) or len(payloads) != len(block_ids):
            raise ValueError(f"expected {len(block_ids)} payloads of {self.block_nbytes} bytes")
        # Zero-initialisation must never run over these blocks later and wipe what is loaded here.
        self.initialize_blocks_through(max(block_ids))
        if self.open_blocks is not None:  # whatever was open there is superseded
            self.open_blocks.forget(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = np.empty((len(block_ids), self.block_nbytes), dtype=np.uint8)
        for row, payload in zip(rows, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        rows = torch.from_numpy(rows).to(self.device)  # the host bytes, moved where the pool is
        offset = 0
        for tensor in self._tensors():
            width = tensor[0].numel() * tensor.element_size()
            band = rows[:, offset : offset + width]
            # A band of whole elements views as the tensor's dtype in place when its offset and the row
            # pitch are multiples of the element size; otherwise it is copied first.
            aligned = offset % tensor.element_size() == 0 and self.block_nbytes % tensor.element_size() == 0
            band = (band if aligned else band.contiguous()).view(tensor.dtype)
            tensor.index_copy_(0, ids, band.view(len(block_ids), *tensor.shape[1:]))
            offset += width

    @property
    def bytes_allocated(self) -> int:
        """The pages and the open blocks (`KVSpec.page_bytes` x blocks + `KVSpec.open_blocks_bytes`)."""
        open_bytes = self.open_blocks.nbytes if self.open_blocks is not None else 0
        return sum(t.numel() * t.element_size() for t in self._tensors()) + open_bytes

    def store_blocks(self, slot: int, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Whole blocks of storage tensor `slot` (K and V `[n, num_kv_heads, block_size, head_dim]`), encoded."""
        self.keys.store_blocks(slot, block_ids, k)
        self.values.store_blocks(slot, block_ids, v)

    def load_blocks(self, slot: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks of storage tensor `slot` as the pool holds them, decoded to float32."""
        return self.keys.load_blocks(slot, block_ids), self.values.load_blocks(slot, block_ids)

    def write(self, layer: int, slot_indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store (encode) new tokens' K/V `[T, num_kv_heads, head_dim]` at flat rows `slot_indices`
        (`[T * num_kv_heads]`, token-major, in the backend's layout)."""
        head_dim = self.spec.head_dim
        if self.open_blocks is not None:
            self.open_blocks.write(self.spec.layout.layer_slot[layer], slot_indices, k.reshape(-1, head_dim),
                                   v.reshape(-1, head_dim))
            return
        if self.one_pass_store and ops.store_kv_(self.k[layer].view(-1, head_dim), self.v[layer].view(-1, head_dim),
                                             slot_indices, k, v):
            return
        self.keys.write(layer, slot_indices, k.reshape(-1, head_dim))
        self.values.write(layer, slot_indices, v.reshape(-1, head_dim))

    def read_rows(self, layer: int, slot_indices: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of flat rows `slot_indices` (as `write` takes them), decoded: `[T, num_kv_heads, head_dim]`."""
        shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        k, v = self.keys.read_rows(layer, slot_indices, dtype), self.values.read_rows(layer, slot_indices, dtype)
        if self.open_blocks is not None:  # rows of open blocks: their float16 copies
            k, v = self.open_blocks.overlay_rows(self.spec.layout.layer_slot[layer], slot_indices, k, v)
        return k.view(shape), v.view(shape)

    def gather(self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype, fold_scales: bool = False) -> GatheredKV:
        """Blocks `block_ids` of `layer` in `dtype`; with `fold_scales`, per-row scales are left to the caller."""
        if self.open_blocks is None:
            k, k_scale = self.keys.read(layer, block_ids, dtype, fold_scales)
            v, v_scale = self.values.read(layer, block_ids, dtype, fold_scales)
            return GatheredKV(k, v, k_scale, v_scale)
        # Open blocks replace whole blocks with their float16 rows: no scale is left to fold.
        (k, _), (v, _) = self.keys.read(layer, block_ids, dtype, False), self.values.read(layer, block_ids, dtype, False)
        return GatheredKV(*self.open_blocks.overlay_blocks(self.spec.layout.layer_slot[layer], block_ids, k, v))
