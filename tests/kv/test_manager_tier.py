"""The KV side of a lower tier: blocks to write through (the pool's stored events), and loaded blocks
adopted into the pool (kv/tier_bridge.py)."""

import pytest

from kvserve.errors import KVIntegrityError
from kvserve.kv.events import BlockStored
from kvserve.kv.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiers.connector import BlockKey
from kvserve.kv.tier_bridge import adopt_loaded, keys_after, room_for_loads

BS = 4


def manager(num_blocks=16):
    return KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=True)


class StoredBlocks:
    """What a tier's write-through hears from the pool: (block id, key) of each block stored."""

    def __init__(self, kv):
        self.stored = []
        kv.pool.subscribe(self.stored.append)

    def take(self):
        taken = [(event.block_id, BlockKey(event.block_hash, event.parent_hash, event.token_ids))
                 for event in self.stored if isinstance(event, BlockStored)]
        self.stored.clear()
        return taken


def compute(kv, request_id, tokens):
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots(request_id, len(tokens), prefix=kv.find_cached_prefix(tokens, chain))
    kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
    kv.free(request_id)


def test_each_newly_cached_block_is_handed_out_once_for_write_through():
    kv = manager()
    written = StoredBlocks(kv)
    tokens = list(range(1, 15))  # 3 full blocks
    compute(kv, "a", tokens)
    taken = written.take()
    assert [key.token_ids for _, key in taken] == [tuple(tokens[i : i + 4]) for i in (0, 4, 8)]
    chain = block_hashes(tokens, BS)
    assert [key.block_hash for _, key in taken] == chain.hashes
    assert [key.parent_hash for _, key in taken] == [chain.root] + chain.hashes[:2]
    compute(kv, "b", tokens)  # all hits: nothing new to write
    assert written.take() == []


def test_adopted_blocks_continue_the_match_and_count_as_the_tiers_once():
    kv = manager()
    tokens = list(range(1, 22))  # 5 full blocks (the 21st token is always computed)
    compute(kv, "a", tokens[:9])  # blocks 0-1 in the pool
    chain = block_hashes(tokens, BS)
    match = kv.find_cached_prefix(tokens, chain)
    keys = keys_after(kv, tokens, chain, match)
    assert match.num_tokens == 8 and len(keys) == 3
    filled = []
    assert adopt_loaded(kv, match, keys, filled.extend) == 3
    assert len(filled) == 3 and kv.num_free_blocks == kv.num_blocks  # cached, but free
    kv.check_integrity()
    match = kv.find_cached_prefix(tokens, chain)
    assert (match.num_tokens, match.num_tier_tokens) == (20, 12)
    assert [block.block_id for block in match.blocks[2:]] == filled
    assert kv.allocate_slots("b", len(tokens), prefix=match)
    kv.free("b")
    assert kv.find_cached_prefix(tokens, chain).num_tier_tokens == 0  # now an ordinary pool hit
    kv.check_integrity()


def test_adopting_never_evicts_the_match_it_continues():
    kv = manager(num_blocks=5)
    tokens = list(range(1, 22))
    compute(kv, "a", tokens[:9])  # blocks 0-1 cached and free, at the LRU head
    chain = block_hashes(tokens, BS)
    match = kv.find_cached_prefix(tokens, chain)
    keys = keys_after(kv, tokens, chain, match)
    assert room_for_loads(kv, match) == 3
    assert adopt_loaded(kv, match, keys, lambda ids: None) == 3
    assert kv.find_cached_prefix(tokens, chain).num_tokens == 20
    assert adopt_loaded(kv, match, keys + keys, lambda ids: None) == 0  # no room: nothing changes
    kv.check_integrity()


def test_a_failed_fill_leaves_no_hashed_block_behind():
    kv = manager()
    tokens = list(range(1, 14))
    chain = block_hashes(tokens, BS)
    match = kv.find_cached_prefix(tokens, chain)

    def broken(block_ids):
        raise OSError("disk went away")

    with pytest.raises(OSError):
        adopt_loaded(kv, match, keys_after(kv, tokens, chain, match), broken)
    assert kv.find_cached_prefix(tokens, chain).num_tokens == 0
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_a_key_already_cached_past_a_gap_keeps_its_pool_copy():
    kv = manager()
    tokens = list(range(1, 18))
    compute(kv, "a", tokens)  # blocks 0-3
    chain = block_hashes(tokens, BS)
    kv.pool._evict(kv.pool.cached_block(chain.hashes[1]))  # a gap at block 1 (as if handed out and reused)
    kv.pool.num_cached_free_blocks -= 1
    match = kv.find_cached_prefix(tokens, chain)
    keys = keys_after(kv, tokens, chain, match)
    assert match.num_tokens == 4 and len(keys) == 3
    assert adopt_loaded(kv, match, keys, lambda ids: None) == 3
    kv.check_integrity()  # the duplicate of block 2 is a plain free block, not a mislabelled one
    assert kv.find_cached_prefix(tokens, chain).num_tier_tokens == 4


def test_integrity_check_catches_a_tier_mark_on_an_empty_block():
    kv = manager()
    kv.pool.blocks[3].from_tier = True
    with pytest.raises(KVIntegrityError, match="lower tier"):
        kv.check_integrity()
