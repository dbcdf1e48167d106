"""The block pool's cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared)."""

from kvserve.kv.events.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager

BS = 4


def manager(num_blocks=8, windows=(None,)):
    kv = KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=True, group_windows=windows)
    events = []
    kv.pool.subscribe(events.append)
    return kv, events


def compute(kv, request_id, tokens):
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots(request_id, len(tokens), prefix=kv.find_cached_prefix(tokens, chain))
    kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
    return chain


def test_each_block_entering_the_cache_is_stored_once_with_its_chain_and_tokens():
    kv, events = manager()
    tokens = list(range(1, 11))  # 2 full blocks
    chain = compute(kv, "a", tokens)
    ids = kv.block_ids("a")[0]
    assert events == [BlockStored(ids[0], chain.hashes[0], chain.root, tuple(tokens[:4]), 0),
                      BlockStored(ids[1], chain.hashes[1], chain.hashes[0], tuple(tokens[4:8]), 0)]
    kv.free("a")
    events.clear()
    compute(kv, "b", tokens)  # hits: nothing new enters the cache
    assert events == []


def test_an_evicted_block_is_removed_and_a_rewritten_one_too():
    kv, events = manager(num_blocks=4)
    tokens = list(range(1, 10))
    chain = compute(kv, "a", tokens)  # blocks 0-1 cached, block 2 holds one token
    kv.free("a")
    events.clear()
    assert kv.allocate_slots("b", 4 * BS)  # the whole pool: both cached blocks are evicted
    assert sorted(events, key=str) == sorted([BlockRemoved(chain.hashes[0], 0), BlockRemoved(chain.hashes[1], 0)],
                                             key=str)
    kv.free("b")
    chain = compute(kv, "c", tokens)
    events.clear()
    assert kv.truncate("c", 6) == 6  # rows 6-7 of block 1 will be rewritten: it leaves the cache
    assert events == [BlockRemoved(chain.hashes[1], 0)]


def test_each_group_stores_its_own_copy():
    kv, events = manager(num_blocks=16, windows=(None, 6))
    chain = compute(kv, "a", list(range(1, 6)))
    assert [(event.group, event.block_hash) for event in events] == [(0, chain.hashes[0]), (1, chain.hashes[0])]


def test_a_reset_clears_every_cached_block_at_once_and_only_when_none_is_in_use():
    kv, events = manager()
    chain = compute(kv, "a", list(range(1, 10)))
    kv.pin(chain, 8, 300.0)
    events.clear()
    assert not kv.pool.reset_cache()  # "a" still runs
    assert events == [] and kv.num_cached_blocks == 2
    kv.free("a")
    assert kv.pool.reset_cache()
    assert events == [AllBlocksCleared()]
    assert kv.num_cached_blocks == kv.num_cached_free_blocks == 0 and kv.pin_stats().num_pins == 0
    kv.check_integrity()


def test_an_unsubscribed_callback_hears_nothing_more():
    kv, events = manager()
    kv.pool.unsubscribe(events.append)
    kv.pool.unsubscribe(events.append)  # twice: a no-op
    compute(kv, "a", list(range(1, 10)))
    assert events == []
