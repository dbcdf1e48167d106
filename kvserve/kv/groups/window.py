"""Sliding-window attention's block tables (DESIGN §3, KV groups).

A windowed layer never reads a key more than `window - 1` positions back, so
the blocks wholly behind the window of a request's next query are freed as it
advances; their table positions hold None (the null block) so the others keep
their positions. A prefix hit needs only the blocks inside the window of the
first token computed after it.
"""

from __future__ import annotations

from kvserve.arith import cdiv
from typing import Sequence

from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import KVBlock
from kvserve.kv.groups.group_manager import BlockLookup, GroupManager
from kvserve.kv.groups.layout import first_needed_block


class SlidingWindowManager(GroupManager):
    keeps_whole_chains = False

    def __init__(self, pool: BlockPool, block_size: int, group: int, window: int) -> None:
        super().__init__(pool, block_size, group)
        self.window = window
        # request -> the table positions before this one are freed (None)
        self._freed_upto: dict[str, int] = {}

    def first_needed_block(self, position: int) -> int:
        return first_needed_block(self.window, position, self.block_size)

    def longest_hit(self, lookup: BlockLookup, num_blocks: int) -> int:
        """vLLM's hybrid search: a miss at block j inside the window rules out every hit longer than j (each
        of them needs block j too), so the answer is j; with no miss, all `num_blocks`."""
        first = self.first_needed_block(num_blocks * self.block_size)
        return next((index for index in range(num_blocks - 1, first - 1, -1) if lookup(index) is None), num_blocks)

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        """The window plus the chunk being computed (every block if chunks are unbounded)."""
        total = cdiv(num_tokens, self.block_size)
        if max_chunk_tokens is None:
            return total
        return min(total, cdiv(self.window - 1 + max_chunk_tokens, self.block_size) + 1)

    def start(self, request_id: str, table: Sequence[KVBlock | None]) -> None:
        super().start(request_id, table)
        self._freed_upto[request_id] = self.tables[request_id].count(None)

    def free_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Null the table positions wholly before the window of position `num_computed_tokens`."""
        table = self.tables.get(request_id)
        if not table:
            return 0
        end = min(self.first_needed_block(num_computed_tokens), len(table))
        start = self._freed_upto[request_id]
        if end <= start:
            return 0
        behind = [block for block in table[start:end] if block is not None]
        table[start:end] = [None] * (end - start)
        self.pool.free(reversed(behind))  # tail first, as a finished request frees
        self._freed_upto[request_id] = end
        return len(behind)

    def resumable_tokens(self, request_id: str, num_tokens: int) -> int:
        """All of them if the window of position `num_tokens` is still held; else none (recomputing any
        later token would need keys the window already let go of)."""
        if self.first_needed_block(num_tokens) >= self._freed_upto.get(request_id, 0):
            return super().resumable_tokens(request_id, num_tokens)
        return 0

    def cut(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        dropped = super().cut(request_id, num_tokens)
        if request_id in self._freed_upto:
            self._freed_upto[request_id] = min(self._freed_upto[request_id], cdiv(num_tokens, self.block_size))
        return dropped

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._freed_upto.pop(request_id, None)
