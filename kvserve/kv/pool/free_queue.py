"""A physical KV block's record and the LRU free queue threaded through it.

The queue is a doubly linked list whose links live in the blocks themselves,
so a block can leave it from the middle in O(1): prefix caching (a freed
block keeps its contents and can be claimed back before it is reused) needs
exactly that. Allocation takes from the head, freeing appends to the tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import BlockHash

# The owner of a block no tenant has allocated yet (tenants are str | None: kv/pool/tenant_quota.py).
UNOWNED = "\0unowned"


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None
    # Set once the block is full and its K/V computed (prefix caching):
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None  # hash of the previous block of the chain (the salt's root: first block)
    token_ids: tuple[int, ...] = ()  # kept so a hash collision can never serve the wrong K/V
    pin_count: int = 0  # live pins covering this block (kv/prefix/pins.py); while free it sits in the pinned queue
    group: int = 0  # the KV group (kv/groups/layout.py) whose content it caches: one hash is cached once per group
    tenant: object = UNOWNED  # who allocated it last (kv/pool/tenant_quota.py): its share counts the block


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

    def appendleft(self, block: KVBlock) -> None:
        """Put a block at the head: it is the next one handed out."""
        first = self._head.next_free
        if first is None:
            raise KVIntegrityError("the free queue's head sentinel lost its link")
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        if last is None:  # the sentinels are linked at construction; only corruption unlinks them
            raise KVIntegrityError("the free queue's tail sentinel lost its link")
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

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free
