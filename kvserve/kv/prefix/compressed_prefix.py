"""The prefix cache for compressing requests (KV compression, issue 43): hits and registration in every KV group.

A compressing request's full-attention groups hold slot blocks, keyed per slot (compressed_keys.slot_keys); its
windowed groups hold token blocks and a hybrid's state snapshots follow its tokens, both keyed by position
(compressed_keys.PositionKeys). A hit ends where a slot key may end (after a chunk's last kept block, or a later
block), where every windowed group still holds the blocks inside the window of the next token, and, for a hybrid,
where a state snapshot resumes it: the longest end all of them agree on.
"""

from __future__ import annotations

from typing import Sequence

from kvserve.kv.compressed_chunks import CompressedRequests
from kvserve.kv.groups.group_manager import GroupManager
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import KVBlock
from kvserve.kv.prefix.compressed_keys import PositionKeys, slot_keys
from kvserve.kv.prefix.hashing import BlockHash, BlockHashChain
from kvserve.kv.state.manager import RecurrentStates


class CompressedPrefix:
    """Lookups and registration of compressing requests' blocks (PrefixCache hands them over)."""

    def __init__(self, pool: BlockPool, block_size: int, groups: Sequence[GroupManager],
                 states: RecurrentStates | None, compressed: CompressedRequests) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups = tuple(groups)
        self.states = states
        self.compressed = compressed
        self._slotted = tuple(manager.group for manager in self.groups if manager.window is None)
        self._positional = tuple(manager.group for manager in self.groups if manager.window is not None)
        self._num_slots: dict[str, int] = {}  # per request: slot blocks registered (full-attention groups)
        self._num_positions: dict[str, int] = {}  # per request: token blocks registered (windowed groups)

    def find(self, token_ids: Sequence[int], chain: BlockHashChain):
        """The longest hit (a PrefixMatch) every group and the recurrent state serve, short of the last token."""
        from kvserve.kv.prefix.prefix_cache import PrefixMatch  # it holds this module: imported when asked

        slotted: list[list[KVBlock]] = [[] for _ in self._slotted]
        ends: list[tuple[int, int, BlockHash]] = []  # (tokens, slot blocks, last key) where a hit may end
        for key in slot_keys(chain.compression, chain, token_ids):
            found = [self.pool.lookup(key.block_hash, key.parent, key.token_ids, group) for group in self._slotted]
            if key.end > len(token_ids) - 1 or any(block is None for block in found):
                break
            for blocks, block in zip(slotted, found):
                blocks.append(block)
            if key.complete:
                ends.append((key.end, len(slotted[0]), key.block_hash))
        positions = PositionKeys(chain.compression, chain)
        num_attention = 0
        for end, num_slots, last in reversed(ends):
            windows = self._window_tables(token_ids, positions, end)
            if windows is None:
                continue
            num_attention = num_attention or end
            state_slot = None
            if self.states is not None:
                state_slot = self.states.snapshot_for(positions, end // self.block_size)
                if state_slot is None:
                    continue
            tables = dict(zip(self._slotted, (tuple(blocks[:num_slots]) for blocks in slotted)))
            tables.update(windows)
            return PrefixMatch(tuple(tables[group] for group in range(len(self.groups))), end, last,
                               state_slot=state_slot, num_attention_tokens=num_attention)
        return PrefixMatch(((),) * len(self.groups), 0, chain.root, num_attention_tokens=num_attention)

    def _window_tables(self, token_ids: Sequence[int], positions: PositionKeys,
                       end: int) -> dict[int, tuple[KVBlock | None, ...]] | None:
        """Per windowed group, a hit of `end` tokens' table (None behind the window), if it holds every block."""
        bs, tables = self.block_size, {}
        for group in self._positional:
            first = self.groups[group].first_needed_block(end)
            table: list[KVBlock | None] = [None] * first
            for index in range(first, end // bs):
                block = self.pool.lookup(positions[index], positions.parent(index),
                                         token_ids[index * bs : (index + 1) * bs], group)
                if block is None:
                    return None
                table.append(block)
            tables[group] = tuple(table)
        return tables

    def state_keys(self, chain: BlockHashChain) -> Sequence[BlockHash]:
        """The keys a hybrid's state snapshots after each token block are registered and found under."""
        return PositionKeys(chain.compression, chain)

    def cache(self, request_id: str, token_ids: Sequence[int], chain: BlockHashChain,
              num_computed_tokens: int) -> None:
        """Register the request's final blocks: slot blocks under their slot keys, token blocks by position."""
        bs = self.block_size
        done, end = self._num_slots.get(request_id, 0), self.compressed.final_slots(request_id, num_computed_tokens, bs)
        if end > done:
            keys = slot_keys(chain.compression, chain, token_ids)
            tables = [self.groups[group].tables[request_id] for group in self._slotted]
            end = min(end, len(keys), *(len(table) for table in tables))
            for group, table in zip(self._slotted, tables):
                for index in range(done, end):
                    key = keys[index]
                    self.pool.cache_block(table[index], key.block_hash, key.parent, key.token_ids, group,
                                          first=index == 0, extra_keys=key.extra)
            self._num_slots[request_id] = max(end, done)
        done, end = self._num_positions.get(request_id, 0), min(num_computed_tokens // bs, len(chain))
        if end > done and self._positional:
            positions = PositionKeys(chain.compression, chain)
            for group in self._positional:
                table = self.groups[group].tables[request_id]
                for index in range(done, min(end, len(table))):
                    if table[index] is not None:  # None: freed behind the window before it was full
                        self.pool.cache_block(table[index], positions[index], positions.parent(index),
                                              tuple(token_ids[index * bs : (index + 1) * bs]), group,
                                              first=index == 0)
            self._num_positions[request_id] = end

    def claimed(self, request_id: str, num_blocks: int) -> None:
        """The request starts with a pool hit of `num_blocks` token blocks (registered already; a part loaded
        from a lower tier after them is registered once it arrives): as many slot blocks as those tokens keep."""
        policy, tokens = self.compressed.policies[request_id], num_blocks * self.block_size
        self._num_positions[request_id] = num_blocks
        self._num_slots[request_id] = (tokens - policy.chunks_before(tokens + 1) * policy.dropped_per_chunk
                                       ) // self.block_size

    def cut(self, request_id: str, num_blocks: int) -> None:
        """The request's token blocks from `num_blocks` on (its slot blocks from as many less its dropped
        ones) hold other K/V than their keys say, or are gone."""
        slots = num_blocks - self.compressed.dropped(request_id) // self.block_size
        if self._num_positions.get(request_id, 0) > num_blocks:
            self._num_positions[request_id] = num_blocks
        if self._num_slots.get(request_id, 0) > slots:
            self._num_slots[request_id] = max(slots, 0)

    def forget(self, request_id: str) -> None:
        self._num_slots.pop(request_id, None)
        self._num_positions.pop(request_id, None)
