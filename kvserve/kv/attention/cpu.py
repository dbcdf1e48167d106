"""The `cpu` attention backend: paged K/V, split-KV / union decode, SDPA prefill chunks.

Cache layout per layer: `[num_blocks, num_kv_heads, block_size, row_width]`,
so one (block, KV head) is a contiguous `[block_size, head_dim]` matrix that
the decode kernels multiply directly. Batch order: decodes first, so all of
them run as one batched decode: on an fp32/fp16/bf16/int8/int4 cache, the C++ kernel that reads
the blocks in place (kvserve/kernels; int8 / int4 blocks widened one at a time, open
blocks read from their float16 slots), else the torch kernels (cpu_decode.py),
which gather them first. Prefill chunks (compute-bound)
gather their request's blocks (from the window's first block, for a windowed
group) and run causal SDPA: cached keys and the chunk's own apart (cpu_prefill.py), or, where a
window cuts the keys, with a bottom-right-aligned mask (reference.py).
Metadata is built once per KV group; each layer attends with its group's.
Without the C++ kernel, decodes that share most of their blocks (a common
prefix) attend over the union of their blocks instead of split-KV
(cpu_metadata.py says when); the kernel reads shared blocks in place faster.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvserve.kernels import ops
from kvserve.kv.attention.base import (AttentionBackend, AttentionContext, KeysFromValues, PlainPagedStep,
                                       SequenceSlice)
from kvserve.kv.attention.cpu_decode import cpp_decode, cpp_decode_reads, split_kv_decode, union_decode
from kvserve.kv.attention.cpu_metadata import (UNION_SHARING_FACTOR, AttentionMetadata, DecodeMetadata,
                                               PrefillMetadata, build_attention_metadata)
from kvserve.kv.attention.cpu_own_blocks import OwnBlocksPlan, own_blocks, plan_own_blocks
from kvserve.kv.attention.cpu_packed import MaterializedLayer, StepRows, attend_materialized, materialize
from kvserve.kv.attention.cpu_prefill import open_block_prefill, prefill_attention
from kvserve.kv.cache.packing import pack_tokens
from kvserve.kv.cache.quant import OPEN_BLOCK_DTYPE
from kvserve.kv.cache.storage import PagedKVCache


def slot_indices(slot_blocks: torch.Tensor, slot_rows: torch.Tensor, num_kv_heads: int, block_size: int,
                 heads: range | None = None) -> torch.Tensor:
    """Rows of the flat `[num_blocks * num_kv_heads * block_size, width]` views for new tokens.

    `[T * len(heads)]`, token-major (as `k.reshape(-1, head_dim)`), computed once per step for all layers;
    `heads`: only these (a packed layer's rows of a slot it shares), else every one.
    """
    heads = torch.arange(heads.start, heads.stop, device=slot_blocks.device) if heads is not None \
        else torch.arange(num_kv_heads, device=slot_blocks.device)
    return ((slot_blocks[:, None] * num_kv_heads + heads[None, :]) * block_size + slot_rows[:, None]).reshape(-1)


class PagedKVContext(AttentionContext):
    """The paged cache plus this step's metadata, one `AttentionMetadata` per KV group."""

    def __init__(self, cache: PagedKVCache, group_metadata: Sequence[AttentionMetadata],
                 decode_kernel: Callable[..., torch.Tensor] | None = None, rows_kernel: bool = False) -> None:
        self.cache = cache
        self.group_metadata = group_metadata
        self.layer_group = cache.spec.layout.layer_group
        # `cpp_decode`: reads the blocks in place; None: gather, then the torch kernels.
        self.decode_kernel = decode_kernel
        # Whether packed layers' materialized blocks run in the C++ kernel (cpu_packed.py).
        self.rows_kernel = rows_kernel
        heads, block_size = cache.spec.num_kv_heads, cache.block_size
        # Per group: the flat rows its new tokens are written to (the builder's where it made them).
        self._slots = [m.slots if m.slots is not None else slot_indices(m.slot_blocks, m.slot_rows, heads, block_size)
                       for m in group_metadata]
        # Every attention layer its own plain slot (all but Gemma 4-style models): attend goes straight there.
        self._uniform = not cache.spec.layer_kv and not cache.spec.layer_sources
        self._written: set[int] = set()  # stored layers this forward has written (their readers follow)
        self._step_rows: dict[int, StepRows] = {}  # per group, for packed layers
        self._materialized: dict[int, MaterializedLayer] = {}  # per packed stored layer, for its readers
        self._open_rows: dict[int, tuple] = {}  # per stored layer with open blocks: (rows before, new K, new V, own)
        self._own_plans: dict[int, OwnBlocksPlan | None] = {}  # per group, with open blocks (cpu_own_blocks.py)

    def plain_paged_step(self) -> PlainPagedStep | None:
        """One KV group of plain float layers, every row attended by the C++ kernel, read in place: what
        `_attend_plain` then does per layer (the one-pass store, then `cpp_decode` without open blocks)."""
        if not self._uniform or len(self.group_metadata) != 1 or self.decode_kernel is not cpp_decode:
            return None
        meta, cache = self.group_metadata[0], self.cache
        if (meta.decode is None or meta.prefills or meta.decode.union_block_ids is not None
                or not cache.one_pass_store or cache.open_blocks is not None or cache.k_params or cache.v_params):
            return None
        return PlainPagedStep(cache.k, cache.v, self._slots[0], meta.decode.row_tables(), SPLIT_BLOCKS)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
               sinks: torch.Tensor | None = None, keys_from_values: KeysFromValues | None = None) -> torch.Tensor:
        if self._uniform:
            if k is None or v is None:
                raise ValueError(f"attention layer {layer} stores its own K/V: it passes them")
            return self._attend_plain(layer, q, k, v, scale, sinks)
        spec = self.cache.spec
        stored = spec.stored_layer(layer)
        reads_another = k is None and v is None
        if reads_another and stored not in self._written:
            raise ValueError(f"attention layer {layer} reads stored layer {stored}, which this forward has not written")
        if not reads_another:
            self._written.add(stored)
        if spec.packed(stored) is not None:
            return self._attend_packed(stored, q, k, v, scale, sinks, keys_from_values, reads_another)
        if k is None and not reads_another:
            raise ValueError(f"attention layer {layer} is stored with keys of its own: it passes them")
        return self._attend_plain(spec.slots_of(stored)[0], q, k, v, scale, sinks)

    def _attend_packed(self, stored: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       scale: float, sinks: torch.Tensor | None, keys_from_values: KeysFromValues | None,
                       reads_another: bool) -> torch.Tensor:
        spec = self.cache.spec
        layer_kv, slots = spec.packed(stored), spec.slots_of(stored)
        # A layer's slots share its window but may lie in different KV groups (each with its own pages): each
        # slot is written and read at its own group's blocks, which hold the same positions.
        groups = [self.layer_group[slot] for slot in slots]
        if not reads_another:
            if layer_kv.k_eq_v != (k is None):
                raise ValueError(f"stored layer {stored} is {'' if layer_kv.k_eq_v else 'not '}K = V")
            rows = spec.rows_of(stored)  # its rows in each of its slots
            k_rows, v_rows = pack_tokens(layer_kv, len(rows) * len(slots), spec.head_dim, k, v)
            for slot, group, k_part, v_part in zip(slots, groups, k_rows.split(len(rows), 1), v_rows.split(len(rows), 1)):
                self.cache.write(slot, self._rows_slots(group, rows), k_part.contiguous(), v_part.contiguous())
        steps = [self._step_rows_of(group) for group in groups]
        blocks = self._materialized.get(stored)
        if blocks is None:
            blocks = self._materialized[stored] = materialize(self.cache, list(zip(slots, steps)), spec.rows_of(stored),
                                                              layer_kv, keys_from_values)
        window = self.group_metadata[groups[0]].sliding_window
        out = attend_materialized(q, blocks, steps[0], scale, window, SPLIT_BLOCKS, sinks, self.rows_kernel)
        return out.to(q.dtype)

    def _rows_slots(self, group: int, rows: range) -> torch.Tensor:
        """The flat rows a group's new tokens are written to, in `rows` of each block (all: the step's own)."""
        if len(rows) == self.cache.spec.num_kv_heads:
            return self._slots[group]
        meta = self.group_metadata[group]
        return slot_indices(meta.slot_blocks, meta.slot_rows, self.cache.spec.num_kv_heads, self.cache.block_size, rows)

    def _step_rows_of(self, group: int) -> StepRows:
        step = self._step_rows.get(group)
        if step is None:
            step = self._step_rows[group] = StepRows.of(self.group_metadata[group], self.cache.block_size)
        return step

    def _attend_plain(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """A plain stored layer read in place (`layer`: its slot of the pool); k = v = None: a layer reading it."""
        group = self.layer_group[layer]
        meta = self.group_metadata[group]
        cache = self.cache
        before = own = None
        if k is None:  # a layer reading this one's cache: what its writer saw of the open blocks
            if cache.open_blocks is not None:
                before, k, v, own = self._open_rows[layer]
        else:
            # With open blocks, a chunk's queries see their own block in float16: the rows of it cached before
            # the chunk are read now, while the block is still open (the write may encode it); so do the rows
            # of a multi-token decode below the last row of a block its write fills.
            if cache.open_blocks is not None:
                before = [self._rows_before(layer, p) for p in meta.prefills]
                own = self._own_blocks(layer, group, k, v)
                self._open_rows[layer] = (before, k, v, own)
            cache.write(layer, self._slots[group], k, v)
        outputs = []
        if meta.decode is not None:
            queries = q[: meta.num_decode_tokens]
            if meta.decode.union_block_ids is not None:  # decodes sharing most of their blocks
                kv = cache.gather(layer, meta.decode.union_block_ids, q.dtype, fold_scales=True)
                outputs.append(union_decode(queries, kv, meta.decode, scale, sinks))
            elif self.decode_kernel is not None:
                outputs.append(self.decode_kernel(cache, layer, queries, meta.decode, scale, SPLIT_BLOCKS, sinks,
                                                  own_blocks=own))
            else:
                kv = cache.gather(layer, meta.decode.block_ids, q.dtype, fold_scales=True)
                outputs.append(split_kv_decode(queries, kv, meta.decode, scale, sinks))
        for index, p in enumerate(meta.prefills):
            kv = cache.gather(layer, p.block_ids, q.dtype)
            num_kv_heads, head_dim = kv.k.shape[1], kv.k.shape[3]
            num_keys = p.seq_len - p.key_start
            keys = kv.k.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
            values = kv.v.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
            queries = q[p.query_start : p.query_end].transpose(0, 1)
            if before is None:
                outputs.append(prefill_attention(queries, keys, values, p.positions, scale, meta.sliding_window,
                                                 p.key_start, sinks))
                continue
            (k_before, v_before), start = before[index], int(p.positions[0])
            own_k = torch.cat([k_before, _as_open(k[p.query_start : p.query_end], q.dtype)]).transpose(0, 1)
            own_v = torch.cat([v_before, _as_open(v[p.query_start : p.query_end], q.dtype)]).transpose(0, 1)
            outputs.append(open_block_prefill(queries, keys, values, own_k, own_v, p.positions, scale,
                                              cache.block_size, meta.sliding_window, p.key_start,
                                              start - start % cache.block_size, sinks))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _own_blocks(self, layer: int, group: int, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The C++ kernel's own blocks of `layer`'s decode rows (cpu_own_blocks.py), read before the write."""
        meta = self.group_metadata[group]
        if meta.decode is None or self.decode_kernel is None:
            return None
        if group not in self._own_plans:
            self._own_plans[group] = plan_own_blocks(meta.decode, self.cache.block_size, self.cache.spec.num_kv_heads)
        plan = self._own_plans[group]
        return None if plan is None else own_blocks(self.cache, layer, plan, k, v)

    def _rows_before(self, layer: int, p: PrefillMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[n, KVH, D]` of the rows of a chunk's first block cached before the chunk."""
        start, block_size = int(p.positions[0]), self.cache.block_size
        count = start % block_size
        block = p.block_ids[(start - count - p.key_start) // block_size]
        rows = torch.arange(count, device=self.cache.device)
        k, v = self.cache.read_rows(layer, slot_indices(block.expand(count), rows, self.cache.spec.num_kv_heads,
                                                        block_size))
        return k, v


def _as_open(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K or V rows as an open block holds them (float16), in `dtype`."""
    return x.to(OPEN_BLOCK_DTYPE).to(dtype)


# Blocks per split of a row in the C++ kernel (each split covers every KV head; a row's splits are merged in
# order). A constant, not a share of the threads per request: a row's splits, hence its bits, must not
# depend on how many rows run beside it. 16 blocks (256 tokens) keep both threads busy on one long decode.
SPLIT_BLOCKS = 16


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, use_cpp_kernels: bool = True) -> None:
        # Built (or loaded from the per-machine cache) now, at engine start, not on the first request.
        self.use_cpp_kernels = use_cpp_kernels and ops.available()
        self.decode_kernel = cpp_decode if self.use_cpp_kernels else None

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, block_size: int, row_width: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, row_width)

    def token_slots(self, cache: PagedKVCache, block_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return slot_indices(block_ids, rows, cache.spec.num_kv_heads, cache.block_size)

    def batch_order(self, num_new_tokens: Sequence[int]) -> list[int]:
        """Decodes (`is_decode`) first, the rest after; stable within each group."""
        return sorted(range(len(num_new_tokens)), key=lambda i: not self.is_decode(num_new_tokens[i]))

    def build_context(self, cache: PagedKVCache, slices: Sequence[SequenceSlice]) -> PagedKVContext:
        kernel = self.decode_kernel if cpp_decode_reads(cache) else None
        # The union is the torch path's (also its faster kernel for a single decode); the C++ kernel beats it.
        factor = UNION_SHARING_FACTOR if kernel is None else None
        # On a float cache every query token, prefill chunks' too, is one row of the C++ kernel: a token's
        # attention is then the same computation however its request was chunked, cached or batched
        # (DESIGN §3 Determinism). A quantized cache's chunks keep the torch path (open_block_prefill).
        as_rows = kernel is not None and cache.open_blocks is None and not cache.k_params and not cache.v_params
        groups = cache.spec.layout.groups
        return PagedKVContext(cache, [build_attention_metadata(slices, cache.block_size, group.window, index,
                                                               union_factor=factor, is_decode=self.is_decode,
                                                               device=cache.device, tokens_as_rows=as_rows,
                                                               block_lists=kernel is None,
                                                               num_kv_heads=cache.spec.num_kv_heads)
                                      for index, group in enumerate(groups)], kernel,
                              rows_kernel=self.use_cpp_kernels and cache.device.type == "cpu")


class TorchCpuAttentionBackend(CpuAttentionBackend):
    """The cpu backend with torch kernels only (what runs where the C++ kernel cannot be built): no C++ runs,
    neither its decode kernel nor its pool's one-pass K/V store."""

    name = "cpu-torch"

    def __init__(self) -> None:
        super().__init__(use_cpp_kernels=False)
