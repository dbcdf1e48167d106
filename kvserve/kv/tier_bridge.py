"""The KV side of a lower tier: where a prefix match could continue in the tier, and blocks read from
it adopted into the pool as cached (engine/tiering.py drives both; the tier itself is kv/tier.py).

What to write through to the tier is not asked here: the tier's traffic subscribes to the pool's
BlockStored events (kv/events.py). A lower tier holds the blocks of a single KV group.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvserve.kv.free_queue import KVBlock
from kvserve.kv.hashing import BlockHashChain
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_cache import PrefixMatch
from kvserve.kv.tiers.connector import BlockKey


def keys_after(kv: KVCacheManager, token_ids: Sequence[int], block_hashes: BlockHashChain,
               match: PrefixMatch) -> list[BlockKey]:
    """The keys of the blocks a hit could still cover after `match`: where a lower tier may continue it."""
    if not kv.enable_caching:
        return []
    bs, hashes = kv.block_size, block_hashes.hashes
    return [BlockKey(hashes[i], block_hashes.parent(i), tuple(token_ids[i * bs : (i + 1) * bs]))
            for i in range(match.num_tokens // bs, kv.prefix.max_hit_blocks(token_ids, block_hashes))]


def room_for_loads(kv: KVCacheManager, match: PrefixMatch) -> int:
    """How many blocks `adopt_loaded` could bring in after `match` now."""
    return kv.num_free_blocks - sum(1 for block in match.blocks if block.ref_cnt == 0)


def adopt_loaded(kv: KVCacheManager, match: PrefixMatch, keys: Sequence[BlockKey],
                 fill: Callable[[list[int]], None]) -> int:
    """Bring blocks read from a lower tier into the pool as cached, free blocks continuing `match`.

    `fill(block_ids)` writes their K/V (the manager holds no tensors); only
    then are they registered under their keys, so a failed fill leaves no
    hashed block with unknown contents. The matched blocks are held meanwhile,
    so taking free blocks cannot evict them. Returns how many were adopted
    (0 if the free blocks do not suffice).
    """
    if kv.num_groups > 1:
        raise ValueError("a lower tier holds the blocks of a single KV group")
    if not keys or len(keys) > room_for_loads(kv, match):
        return 0
    pool = kv.pool
    pool.touch(match.blocks)
    fresh: list[KVBlock] = []
    try:
        fresh = pool.allocate(len(keys))
        fill([block.block_id for block in fresh])
        for index, (block, key) in enumerate(zip(fresh, keys), start=len(match.blocks)):
            # A key already cached in the pool (past a gap in the chain) keeps its pool copy.
            block.from_tier = pool.cache_block(block, key.block_hash, key.parent_hash, key.token_ids,
                                               first=index == 0)
    finally:
        # Tail first, as a finished request frees: chain ends are evicted before their roots.
        pool.free(reversed(fresh))
        pool.free(reversed(match.blocks))
    return len(fresh)
