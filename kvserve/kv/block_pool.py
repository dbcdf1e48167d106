"""Physical KV blocks: ids, reference counts and the free queue.

Every block is created once, at startup. A block is either in use (ref_cnt > 0)
or in the free queue, never both. A full block can carry a hash (prefix
caching) and keeps it while free, until it is handed out again. The free queue is a doubly linked list so a
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
    # Set once the block is full and its K/V computed (prefix caching):
    block_hash: int | None = None
    parent_hash: int | None = None  # hash of the previous block of the chain (None: first block)
    token_ids: tuple[int, ...] = ()  # kept so a hash collision can never serve the wrong K/V


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
    """All blocks, the free queue, and (with prefix caching) hash -> cached block.

    A cached block keeps its hash while free, so a later request can claim it
    back (`touch`); its hash is dropped only when the block is handed out anew.
    """

    def __init__(self, num_blocks: int, block_size: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        # parent hash -> cached children: what lets a miss be explained to the token.
        self.children: dict[int | None, dict[int, KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue (ref_cnt 1 each), evicting their cached content."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} are free")
        taken = [self.free_queue.popleft() for _ in range(count)]
        for block in taken:
            self._evict(block)
            block.ref_cnt = 1
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on cached blocks, claiming free ones back from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

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

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block under its hash. If another block already
        holds the same content, that one stays the cached copy."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached[block_hash] = block
        self.children.setdefault(parent_hash, {})[block_hash] = block

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None  # absent, or a hash collision: never serve other tokens' K/V
        return block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        siblings = self.children[block.parent_hash]
        del siblings[block.block_hash]
        if not siblings:
            del self.children[block.parent_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()

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
            if block.block_hash is not None:
                assert len(block.token_ids) == self.block_size, f"hashed block {block.block_id} is not full"
                assert self.cached.get(block.block_hash) is block, f"hashed block {block.block_id} not in the map"
        assert all(b.block_hash == h for h, b in self.cached.items()), "hash map points at a re-used block"
        assert sum(len(c) for c in self.children.values()) == len(self.cached), "children index out of sync"
