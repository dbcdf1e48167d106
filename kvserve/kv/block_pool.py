"""Physical KV blocks: ids, reference counts and the free queue.

Every block is created once, at startup. A block is either in use (ref_cnt > 0)
or in the free queue, never both. The free queue is a doubly linked list so a
block can leave it from the middle in O(1): prefix caching (a freed block keeps
its contents and can be claimed back before it is reused) needs exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: allocate from the head, free to the tail (LRU order)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue (ref_cnt 1 each)."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} are free")
        taken = [self.free_queue.popleft() for _ in range(count)]
        for block in taken:
            block.ref_cnt = 1
        return taken

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the free queue's tail.

        Callers pass a request's blocks tail-first, so the ends of block chains
        are reused before their roots.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        free = list(self.free_queue)
        assert len(free) == len(self.free_queue), "free queue length is wrong"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is in the free queue twice"
        for block in self.blocks:
            if block.block_id in free_ids:
                assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor referenced (leak)"
