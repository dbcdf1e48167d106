"""The KV side of the tiers: one lookup gives the pool's hit and the tiers' continuation, slots cover both,
loaded blocks belong to their request, and the blocks to write through are the pool's stored events."""

import pytest

from kvserve.kv.events.events import BlockStored
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiers.connector import BlockKey, TierConnector
from tests.kv.tiers.fakes import DictTier

BS = 4


def manager(num_blocks=16, tiers=None, enable_caching=True):
    return KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=enable_caching, tiers=tiers)


def keys_of(tokens, chain, blocks):
    return [BlockKey(chain.hashes[i], chain.parent(i), tuple(tokens[i * BS : (i + 1) * BS])) for i in blocks]


def compute(kv, request_id, tokens):
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots(request_id, len(tokens), prefix=kv.find_cached_prefix(tokens, chain))
    kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
    kv.free(request_id)


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


def tiered(tokens, pool_blocks, tier_blocks, num_blocks=16):
    """A manager whose pool caches blocks `pool_blocks` of `tokens` and whose tier holds `tier_blocks`."""
    tier = DictTier()
    kv = manager(num_blocks, TierConnector([tier]))
    chain = block_hashes(tokens, BS)
    compute(kv, "warm", tokens[: pool_blocks * BS + 1])
    tier.store([(key, bytes([i])) for i, key in zip(tier_blocks, keys_of(tokens, chain, tier_blocks))])
    return kv, tier, chain


def test_one_lookup_returns_the_pool_hit_and_the_tier_continuation():
    tokens = list(range(1, 22))  # 5 full blocks (the 21st token is always computed)
    kv, tier, chain = tiered(tokens, pool_blocks=2, tier_blocks=range(5))
    match = kv.match_prefix(tokens, chain)
    assert tier.lookups == 1
    assert (match.num_tokens, match.num_pool_tokens, match.num_tier_tokens) == (20, 8, 12)
    assert list(match.tier.keys) == keys_of(tokens, chain, [2, 3, 4])  # asked only past the pool's hit
    assert match.last_hash == chain.hashes[4]
    assert kv.find_cached_prefix(tokens, chain).tier is None  # the pool alone never asks the tier
    assert tier.lookups == 1


def test_a_tier_continues_a_hit_only_as_far_as_a_pool_hit_could_go():
    tokens = list(range(1, 21))  # exactly 5 blocks: the last token is computed, so at most 4 blocks hit
    kv, tier, chain = tiered(tokens, pool_blocks=0, tier_blocks=range(5))
    match = kv.match_prefix(tokens, chain)
    assert (match.num_tokens, len(match.tier.keys)) == (16, 4)


def test_a_tier_that_lacks_the_next_block_gives_no_continuation():
    tokens = list(range(1, 22))
    kv, tier, chain = tiered(tokens, pool_blocks=2, tier_blocks=[3, 4])  # a gap at block 2
    match = kv.match_prefix(tokens, chain)
    assert (match.num_tokens, match.tier) == (8, None)
    uncached = manager(tiers=TierConnector([tier]), enable_caching=False)
    assert uncached.match_prefix(tokens, chain).num_tokens == 0 and tier.lookups == 1  # not asked at all


def test_the_first_tier_in_the_list_that_holds_the_next_block_continues_the_match():
    tokens = list(range(1, 22))
    chain = block_hashes(tokens, BS)
    near, far = DictTier("host"), DictTier("disk")
    far.store([(key, b"") for key in keys_of(tokens, chain, range(5))])
    near.store([(key, b"") for key in keys_of(tokens, chain, range(2))])
    connector = TierConnector([near, far])
    assert manager(tiers=connector).match_prefix(tokens, chain).tier.tier == 0  # near holds block 0: it serves
    near.blocks.clear()
    assert manager(tiers=connector).match_prefix(tokens, chain).tier.tier == 1
    with pytest.raises(ValueError, match="distinct names"):
        TierConnector([DictTier("disk"), DictTier("disk")])


def test_slots_cover_both_parts_and_blocks_being_loaded_are_never_free():
    tokens = list(range(1, 22))
    kv, tier, chain = tiered(tokens, pool_blocks=2, tier_blocks=range(5), num_blocks=8)
    match = kv.match_prefix(tokens, chain)
    assert kv.allocate_slots("b", match.num_tokens, prefix=match)
    load = kv.tier_load("b", match)
    assert load.hit == match.tier and len(load.block_ids) == 3
    assert kv.block_ids("b")[0][2:] == list(load.block_ids)  # after the pool's two shared blocks
    assert kv.num_blocks_held("b") == 5 and kv.num_free_blocks == 3
    taken = kv.pool.allocate(kv.num_free_blocks)  # whatever else the pool hands out, never these
    assert not {block.block_id for block in taken} & set(load.block_ids)
    kv.pool.free(taken)
    kv.check_integrity()
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_what_a_load_delivered_is_cached_and_what_it_did_not_is_a_plain_block_to_recompute():
    tokens = list(range(1, 22))
    kv, tier, chain = tiered(tokens, pool_blocks=2, tier_blocks=range(5))
    match = kv.match_prefix(tokens, chain)
    assert kv.allocate_slots("b", match.num_tokens, prefix=match)
    load = kv.tier_load("b", match)
    kv.cache_full_blocks("b", tokens, chain, match.num_pool_tokens + BS)  # one of three blocks arrived intact
    assert kv.find_cached_prefix(tokens, chain).num_tokens == 12
    assert [kv.pool.blocks[i].block_hash for i in load.block_ids] == [chain.hashes[2], None, None]
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.num_cached_blocks == 3


def test_the_tier_part_of_a_match_is_loaded_only_into_a_request_that_took_slots_for_it():
    tokens = list(range(1, 22))
    kv, _, chain = tiered(tokens, pool_blocks=2, tier_blocks=[])
    with pytest.raises(ValueError, match="does not continue in a lower tier"):
        kv.tier_load("b", kv.match_prefix(tokens, chain))
