"""The block pool's accounting invariants (DESIGN §4), checked from outside the pool: queues, counters,
the hash map and the per-tenant counts all agree with the blocks."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvserve.errors import KVIntegrityError

if TYPE_CHECKING:
    from kvserve.kv.pool.block_pool import BlockPool


def check_pool_integrity(pool: BlockPool) -> None:
    """Raise KVIntegrityError (never a bare assert: `python -O` must not silence it) if the pool is inconsistent."""
    pinned_free = list(pool.pinned_free_queue)
    if len(pinned_free) != len(pool.pinned_free_queue):
        raise KVIntegrityError(f"pinned free queue length is {len(pool.pinned_free_queue)} but it links "
                               f"{len(pinned_free)} blocks")
    if any(block.pin_count <= 0 for block in pinned_free):
        raise KVIntegrityError("an unpinned block sits in the pinned free queue")
    unpinned_free = list(pool.free_queue)
    if len(unpinned_free) != len(pool.free_queue):
        raise KVIntegrityError(f"free queue length is {len(pool.free_queue)} but it links {len(unpinned_free)} blocks")
    if any(block.pin_count for block in unpinned_free):
        raise KVIntegrityError("a pinned block sits in the ordinary free queue")
    pinned = [block for block in pool.blocks if block.pin_count]
    if len(pinned) != pool.num_pinned_blocks:
        raise KVIntegrityError(f"{len(pinned)} blocks are pinned, the counter says {pool.num_pinned_blocks}")
    if any(block.block_hash is None for block in pinned):
        raise KVIntegrityError("a pinned block holds no prefix")
    free = unpinned_free + pinned_free
    free_ids = {b.block_id for b in free}
    if len(free_ids) != len(free):
        raise KVIntegrityError("a block is in the free queue twice")
    cached_free = 0
    for block in pool.blocks:
        if block.block_id in free_ids:
            if block.ref_cnt != 0:
                raise KVIntegrityError(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
            cached_free += block.block_hash is not None
        elif block.ref_cnt <= 0:
            raise KVIntegrityError(f"block {block.block_id} is neither free nor referenced (leak)")
        if block.block_hash is not None:
            if len(block.token_ids) != pool.block_size:
                raise KVIntegrityError(f"hashed block {block.block_id} holds {len(block.token_ids)} tokens, "
                                       f"not a full block of {pool.block_size}")
            if pool.cached.get((block.group, block.block_hash)) is not block:
                raise KVIntegrityError(f"hashed block {block.block_id} is not in the hash map")
    if not all(b.block_hash == h and b.group == g for (g, h), b in pool.cached.items()):
        raise KVIntegrityError("the hash map points at a re-used block")
    if sum(len(c) for c in pool.children.values()) != len(pool.cached):
        raise KVIntegrityError("the children index is out of sync with the hash map")
    if cached_free != pool.num_cached_free_blocks:
        raise KVIntegrityError(f"{cached_free} free blocks hold a cached prefix, "
                               f"the counter says {pool.num_cached_free_blocks}")
    held = Counter(block.tenant for block in pool.blocks)
    cached_by_tenant = Counter(b.tenant for b in free if b.block_hash is not None)
    if +pool.quota.held != held or +pool.quota.cached_free != cached_by_tenant:
        raise KVIntegrityError("the per-tenant block counts are out of sync with the blocks")
