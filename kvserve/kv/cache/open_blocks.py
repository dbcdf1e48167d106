"""The blocks still being filled, in float16, for a pool whose keys are encoded per channel over a whole block.

A blockwise codec (kv/cache/quant.py: int4 keys, KIVI's layout) needs every row of a
block before it can choose its channels' scales, so a block lives here, K and
V in float16, from its first write until the write that fills its last row
(row block_size - 1: a request's tokens are written in position order); that
write encodes it into the pool once, and it is never encoded again unless it
is written again. The rule is the storage's own: the pool sees writes, not
requests. Attention reads an open block here (`slot_of`), any other in the pool.

Room: `num_slots` open blocks per storage tensor (one per request of a full
batch and KV group, KVSpec.open_slots). Each tensor keeps its own state, so
its layers stay consistent whatever order they are written in. A block a
request freed while open keeps its slot until that slot is needed: then the
least recently written block is encoded as it is (its rows so far) and, if it
is written again, decoded back into a slot (a rare, lossy double rounding that
only a request starved of steps for longer than the whole batch could meet).
A run of several rows (a verify of drafts, forced tokens) can fill a request's
open block and start its next: when the slots run short, the write seals the
blocks it fills first and then opens the others in the slots they freed.
Rewrites below a full block's last row (rejected speculative tokens, a context
shift moving rows in place) reopen it: from its float16 rows where the slot it
was encoded from still holds them (a sealed slot is taken again last), so a
block that rejected drafts filled reopens with the bits it had before they
came; else decoded back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.errors import KVIntegrityError
from kvserve.kernels import ops
from kvserve.kv.cache.quant import OPEN_BLOCK_DTYPE


class BlockCodecs(Protocol):
    """What the pool does for the open blocks: whole blocks of one storage tensor, encoded and decoded."""

    def store_blocks(self, slot: int, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def load_blocks(self, slot: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class _WritePlan:
    """What one write's flat rows touch (the same for every layer of a step: computed once per slot tensor)."""

    blocks: list[int]  # touched blocks, ascending
    first_row: list[int]  # per block: the lowest row written
    last: list[bool]  # per block: its last row is written (it becomes full)
    whole: list[bool]  # per block: every row of every head is written now (encoded directly)
    row_block: torch.Tensor  # [R] index into `blocks` of each written row
    within: torch.Tensor  # [R] the row's place inside its block (head-major, as the layout)
    cached_slots: tuple[int, ...] = ()
    cached_rows: torch.Tensor | None = field(default=None, repr=False)
    # When the slots run short: (rows of the blocks this write fills, their plan), then the rest (see `write`).
    parts: list[tuple[torch.Tensor, "_WritePlan"]] | None = field(default=None, repr=False)


def _analyse(rows: torch.Tensor, block_rows: int, block_size: int) -> _WritePlan:
    """What a write of flat rows `rows` touches, block by block."""
    block = torch.div(rows, block_rows, rounding_mode="floor")
    within = rows - block * block_rows
    blocks, row_block = torch.unique(block, return_inverse=True)
    count = torch.bincount(row_block, minlength=blocks.numel())
    row = within % block_size
    first = torch.full_like(blocks, block_size).scatter_reduce_(0, row_block, row, "amin")
    last = torch.zeros_like(blocks).scatter_reduce_(0, row_block, row, "amax") == block_size - 1
    return _WritePlan(blocks.tolist(), first.tolist(), last.tolist(), (count == block_rows).tolist(),
                      row_block, within)


class OpenBlocks:
    def __init__(self, codecs: BlockCodecs, num_tensors: int, num_slots: int, num_blocks: int, num_kv_heads: int,
                 block_size: int, head_dim: int, device: torch.device, use_cpp_kernels: bool = True) -> None:
        if num_slots < 1:
            raise ValueError("a pool with blockwise codecs needs at least one open-block slot")
        self.codecs = codecs
        self.use_cpp_kernels = use_cpp_kernels
        self.num_slots, self.block_size, self.device = num_slots, block_size, device
        self.block_rows = num_kv_heads * block_size  # flat rows of one block
        shape = (num_slots, num_kv_heads, block_size, head_dim)
        # Zeroed: attention reads a partly filled block's hidden rows with a zero weight (0 x NaN = NaN).
        self.k = [torch.zeros(shape, dtype=OPEN_BLOCK_DTYPE, device=device) for _ in range(num_tensors)]
        self.v = [torch.zeros(shape, dtype=OPEN_BLOCK_DTYPE, device=device) for _ in range(num_tensors)]
        # Per tensor: block -> slot (-1: in the pool), on the host for decisions and, for the readers
        # (the C++ kernel takes it as it is on the CPU), on the pool's device.
        self._host = [torch.full((num_blocks,), -1, dtype=torch.long, device="cpu") for _ in range(num_tensors)]
        self.slot_of = self._host if device.type == "cpu" else [t.to(device) for t in self._host]
        self._map = [t.numpy() for t in self._host]  # the same memory: element reads ~30x cheaper than a tensor's
        self._owner = [[-1] * num_slots for _ in range(num_tensors)]
        # Per tensor: block -> the free slot still holding its float16 rows since it was encoded, and back.
        self._kept: list[dict[int, int]] = [{} for _ in range(num_tensors)]
        self._kept_in: list[dict[int, int]] = [{} for _ in range(num_tensors)]
        self._stamp = [[0] * num_slots for _ in range(num_tensors)]
        self._clock = [0] * num_tensors
        self.encodes = 0  # blocks encoded into the pool (tests follow the lifecycle with it)
        self._plan_key: tuple[torch.Tensor, int] | None = None
        self._plan: _WritePlan | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, tensor: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New K/V `[R, head_dim]` (any float dtype) at the pool's flat rows `rows` of storage tensor `tensor`."""
        plan = self._plan_for(rows)
        if self._short_of_slots(tensor, plan) and (parts := self._split(plan, rows)):
            # A run of several tokens (a verify of drafts, forced tokens) can fill one open block and start the
            # next while every slot is held by this write: fill and seal the blocks it completes first, then
            # write the rest into the slots they freed. Same rows, same bits, two passes.
            for index, part in parts:
                self._write_plan(tensor, part, k.index_select(0, index), v.index_select(0, index))
            return
        self._write_plan(tensor, plan, k, v)

    def _write_plan(self, tensor: int, plan: _WritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        self._clock[tensor] += 1
        slots: list[int] = []
        reopen: list[tuple[int, int]] = []  # (block, slot) whose rows below the write must be decoded back
        for block in plan.blocks:  # open blocks of this write are never the ones evicted for another of it
            slot = int(self._map[tensor][block])
            if slot >= 0:
                self._stamp[tensor][slot] = self._clock[tensor]
        for index, block in enumerate(plan.blocks):
            slot = int(self._map[tensor][block])
            if plan.whole[index]:
                if slot >= 0:
                    self._release(tensor, slot)
                slots.append(-1)
                continue
            if slot < 0:
                kept = self._kept[tensor].get(block) if plan.first_row[index] > 0 else None
                slot = self._take_slot(tensor, block, kept)
                if plan.first_row[index] > 0 and kept is None:
                    reopen.append((block, slot))
            self._stamp[tensor][slot] = self._clock[tensor]
            slots.append(slot)
        if reopen:
            ids = torch.tensor([b for b, _ in reopen], dtype=torch.long, device=self.device)
            at = torch.tensor([s for _, s in reopen], dtype=torch.long, device=self.device)
            old_k, old_v = self.codecs.load_blocks(tensor, ids)
            self.k[tensor].index_copy_(0, at, old_k.to(OPEN_BLOCK_DTYPE))
            self.v[tensor].index_copy_(0, at, old_v.to(OPEN_BLOCK_DTYPE))
        whole = [i for i, w in enumerate(plan.whole) if w]
        if len(whole) < len(plan.blocks):
            self._store_rows(tensor, plan, slots, k, v)
        if whole:
            self._encode_whole(tensor, plan, whole, k, v)
        full = [(plan.blocks[i], slots[i]) for i, last in enumerate(plan.last) if last and not plan.whole[i]]
        if full:
            self._seal(tensor, full)

    def close(self, block_ids: list[int]) -> None:
        """Encode these blocks into the pool wherever they are open (before their bytes are read out whole)."""
        for tensor, host in enumerate(self._map):
            open_ = [(b, int(host[b])) for b in block_ids if host[b] >= 0]
            if open_:
                self._seal(tensor, open_)

    def forget(self, block_ids: list[int]) -> None:
        """These blocks' contents now come from elsewhere (loaded whole into the pool): drop their open rows."""
        for tensor, host in enumerate(self._map):
            for b in block_ids:
                if host[b] >= 0:
                    self._release(tensor, int(host[b]))
                self._drop_kept(tensor, self._kept[tensor].get(b))

    def overlay_blocks(self, tensor: int, block_ids: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks `block_ids` as read from the pool (K, V `[n, KVH, block_size, D]`), open ones replaced
        by their float16 rows."""
        slots = self.slot_of[tensor].index_select(0, block_ids)
        where = (slots >= 0).nonzero().flatten()
        if where.numel():
            at = slots.index_select(0, where)
            k = k.index_copy(0, where, self.k[tensor].index_select(0, at).to(k.dtype))
            v = v.index_copy(0, where, self.v[tensor].index_select(0, at).to(v.dtype))
        return k, v

    def overlay_rows(self, tensor: int, rows: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat rows `rows` as read from the pool (K, V `[R, D]`), those of open blocks replaced likewise."""
        blocks = torch.div(rows, self.block_rows, rounding_mode="floor")
        slots = self.slot_of[tensor].index_select(0, blocks)
        where = (slots >= 0).nonzero().flatten()
        if where.numel():
            at = slots.index_select(0, where) * self.block_rows + (rows - blocks * self.block_rows).index_select(0, where)
            head_dim = k.shape[-1]
            k = k.index_copy(0, where, self.k[tensor].view(-1, head_dim).index_select(0, at).to(k.dtype))
            v = v.index_copy(0, where, self.v[tensor].view(-1, head_dim).index_select(0, at).to(v.dtype))
        return k, v

    # -- internals --

    def _plan_for(self, rows: torch.Tensor) -> _WritePlan:
        # Every layer of a step writes the same rows tensor: analyse it once (the tensor is kept, so its
        # identity cannot be reused by another; its version changes if it is written in place).
        key = (rows, rows._version)
        if self._plan_key is not None and self._plan_key[0] is rows and self._plan_key[1] == key[1]:
            return self._plan
        self._plan = _analyse(rows, self.block_rows, self.block_size)
        self._plan_key = key
        return self._plan

    def _short_of_slots(self, tensor: int, plan: _WritePlan) -> bool:
        """Whether the write's blocks without a slot outnumber the slots it could take (free or not its own)."""
        host = self._map[tensor]
        need = sum(1 for i, b in enumerate(plan.blocks) if not plan.whole[i] and host[b] < 0)
        if need == 0:
            return False
        mine = set(plan.blocks)
        return need > sum(1 for owner in self._owner[tensor] if owner < 0 or owner not in mine)

    def _split(self, plan: _WritePlan, rows: torch.Tensor) -> list[tuple[torch.Tensor, _WritePlan]] | None:
        """The write as (row indices, plan) parts: the rows of the blocks it fills but does not bring whole,
        then the others; None when it fills none (nothing to seal early) or nothing else."""
        if plan.parts is None:
            filled = [i for i, (last, whole) in enumerate(zip(plan.last, plan.whole)) if last and not whole]
            first = torch.isin(plan.row_block, torch.tensor(filled, dtype=torch.long, device=plan.row_block.device))
            indices = [first.nonzero().flatten(), (~first).nonzero().flatten()]
            plan.parts = [] if not filled or not indices[1].numel() else [
                (index, _analyse(rows.index_select(0, index), self.block_rows, self.block_size)) for index in indices]
        return plan.parts or None

    def _take_slot(self, tensor: int, block: int, kept: int | None = None) -> int:
        """A slot for `block`: `kept` (the free slot holding its rows since it was encoded), else a free one
        (those holding no block's rows first), else the least recently written block's, encoded."""
        owner, stamp, kept_in = self._owner[tensor], self._stamp[tensor], self._kept_in[tensor]
        self._drop_kept(tensor, self._kept[tensor].get(block))  # taken now, or its rows are rewritten
        free = kept
        if free is None:
            empty = [s for s in range(self.num_slots) if owner[s] < 0]
            free = next((s for s in empty if s not in kept_in), empty[0] if empty else None)
        self._drop_kept(tensor, free)
        if free is None:
            # The least recently written block not written by this write (stamped with the clock).
            candidates = [s for s in range(self.num_slots) if stamp[s] != self._clock[tensor]]
            if not candidates:
                raise KVIntegrityError(f"one write fills more blocks at once than the {self.num_slots} open-block "
                                       f"slots (max_num_seqs x KV groups)")
            free = min(candidates, key=stamp.__getitem__)
            self._seal(tensor, [(owner[free], free)])
            self._drop_kept(tensor, free)  # evicted: its rows give way to the new block's
        owner[free] = block
        self._set(tensor, block, free)
        return free

    def _drop_kept(self, tensor: int, slot: int | None) -> None:
        """Slot `slot` no longer stands for the rows of the block it was encoded from."""
        if slot is not None and slot in self._kept_in[tensor]:
            del self._kept[tensor][self._kept_in[tensor].pop(slot)]

    def _release(self, tensor: int, slot: int) -> None:
        self._set(tensor, self._owner[tensor][slot], -1)
        self._owner[tensor][slot] = -1

    def _set(self, tensor: int, block: int, slot: int) -> None:
        self._map[tensor][block] = slot
        if self.slot_of[tensor] is not self._host[tensor]:
            self.slot_of[tensor][block] = slot

    def _seal(self, tensor: int, blocks_slots: list[tuple[int, int]]) -> None:
        """Encode open blocks into the pool (once) and free their slots."""
        ids = torch.tensor([b for b, _ in blocks_slots], dtype=torch.long, device=self.device)
        at = torch.tensor([s for _, s in blocks_slots], dtype=torch.long, device=self.device)
        self.codecs.store_blocks(tensor, ids, self.k[tensor].index_select(0, at), self.v[tensor].index_select(0, at))
        self.encodes += len(blocks_slots)
        for block, slot in blocks_slots:
            self._release(tensor, slot)
            self._kept[tensor][block], self._kept_in[tensor][slot] = slot, block

    def _store_rows(self, tensor: int, plan: _WritePlan, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows of open blocks into their slots (rows of whole blocks land on a dummy row and are dropped)."""
        if tuple(slots) != plan.cached_slots or plan.cached_rows is None:
            slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
            target = slot_t.index_select(0, plan.row_block)
            plan.cached_rows = target * self.block_rows + plan.within
            plan.cached_slots = tuple(slots)
        target_rows = plan.cached_rows
        keep = None
        if -1 in slots:  # some rows belong to whole blocks, encoded apart
            keep = (target_rows >= 0).nonzero().flatten()
            target_rows, k, v = target_rows.index_select(0, keep), k.index_select(0, keep), v.index_select(0, keep)
        head_dim = self.k[tensor].shape[-1]
        k_rows, v_rows = self.k[tensor].view(-1, head_dim), self.v[tensor].view(-1, head_dim)
        if not (self.use_cpp_kernels
                and ops.store_kv_(k_rows, v_rows, target_rows, k.reshape(-1, 1, head_dim), v.reshape(-1, 1, head_dim))):
            k_rows.index_copy_(0, target_rows, k.to(OPEN_BLOCK_DTYPE))
            v_rows.index_copy_(0, target_rows, v.to(OPEN_BLOCK_DTYPE))

    def _encode_whole(self, tensor: int, plan: _WritePlan, whole: list[int], k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """Blocks every row of which this write brings: straight into the pool, never through a slot."""
        rank = torch.full((len(plan.blocks),), -1, dtype=torch.long, device=self.device)
        rank[torch.tensor(whole, dtype=torch.long, device=self.device)] = torch.arange(
            len(whole), dtype=torch.long, device=self.device)
        dest = rank.index_select(0, plan.row_block) * self.block_rows + plan.within
        picked = (dest >= 0).nonzero().flatten()
        shape = (len(whole), *self.k[tensor].shape[1:])
        # Staged in float16, as a block filled through a slot is: its encoding never depends on how the rows came.
        staged_k = torch.empty(shape, dtype=OPEN_BLOCK_DTYPE, device=self.device)
        staged_v = torch.empty(shape, dtype=OPEN_BLOCK_DTYPE, device=self.device)
        head_dim = shape[-1]
        at = dest.index_select(0, picked)
        staged_k.view(-1, head_dim).index_copy_(0, at, k.index_select(0, picked).to(OPEN_BLOCK_DTYPE))
        staged_v.view(-1, head_dim).index_copy_(0, at, v.index_select(0, picked).to(OPEN_BLOCK_DTYPE))
        ids = torch.tensor([plan.blocks[i] for i in whole], dtype=torch.long, device=self.device)
        for i in whole:
            self._drop_kept(tensor, self._kept[tensor].get(plan.blocks[i]))
        self.codecs.store_blocks(tensor, ids, staged_k, staged_v)
        self.encodes += len(whole)
