"""Pinned prefixes: evicted last (a second free queue), never blocking a request, within a cap, with a TTL."""

import pytest

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix.pins import cache_write_tokens

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks=8, fraction=0.5, clock=None):
    return KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=True, max_pinned_fraction=fraction,
                          clock=clock or FakeClock())


def cache_prompt(kv, request_id, tokens):
    """Run a request over `tokens` to completion: its full blocks end up cached and free."""
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots(request_id, len(tokens), prefix=kv.find_cached_prefix(tokens, chain))
    kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
    kv.free(request_id)
    return chain


def cached_tokens(kv, tokens):
    return kv.find_cached_prefix(tokens + [0], block_hashes(tokens + [0], BS)).num_tokens


def test_pinned_blocks_are_evicted_after_every_unpinned_one():
    kv = manager(num_blocks=8)
    pinned = list(range(100, 108))  # 2 blocks
    chain = cache_prompt(kv, "p", pinned)
    assert kv.pin(chain, len(pinned), ttl_s=300) == 2
    cache_prompt(kv, "q", list(range(200, 224)))  # 6 blocks: fills the rest of the pool
    # Six fresh blocks evict the six unpinned ones (the least recently used first), not the pinned two.
    assert kv.allocate_slots("r", 6 * BS)
    assert cached_tokens(kv, pinned) == 8
    assert kv.pool.num_pinned_blocks == 2
    kv.check_integrity()


def test_a_request_that_needs_pinned_blocks_gets_them_and_the_pin_lapses():
    kv = manager(num_blocks=8, fraction=1.0)
    chain = cache_prompt(kv, "p", list(range(100, 132)))  # the whole pool, cached and free
    assert kv.pin(chain, 32, ttl_s=300) == 8
    assert kv.num_free_blocks == 8  # pins hold no reference: every block is still allocatable
    assert kv.allocate_slots("big", 8 * BS)  # a request wins over a pin: no deadlock
    stats = kv.pin_stats()
    assert stats.num_pins == 0 and stats.pins_lapsed == 1 and stats.num_pinned_blocks == 0
    kv.check_integrity()
    kv.free("big")
    kv.check_integrity()


def test_pins_expire_after_their_ttl_and_their_blocks_go_first():
    clock = FakeClock()
    kv = manager(num_blocks=8, clock=clock)
    pinned = list(range(100, 108))
    kv.pin(cache_prompt(kv, "p", pinned), 8, ttl_s=300)
    clock.now += 299
    assert kv.expire_pins() == 0 and kv.pool.num_pinned_blocks == 2
    clock.now += 2
    assert kv.expire_pins() == 1
    assert kv.pool.num_pinned_blocks == 0 and kv.pin_stats().pins_expired == 1
    assert [b.block_hash for b in list(kv.pool.free_queue)[:2]] == [chain for chain in reversed(
        block_hashes(pinned, BS).hashes)]  # an expired pin's blocks are next in line, chain end first
    kv.check_integrity()


def test_a_hit_refreshes_the_pin():
    clock = FakeClock()
    kv = manager(num_blocks=8, clock=clock)
    prompt = list(range(100, 108))
    kv.pin(cache_prompt(kv, "p", prompt), 8, ttl_s=300)
    clock.now += 200
    cache_prompt(kv, "hit", prompt + [1, 2])  # shares both pinned blocks
    clock.now += 200  # 400 s after the pin, 200 s after the hit
    assert kv.expire_pins() == 0 and kv.pin_stats().pins_refreshed == 1
    clock.now += 101
    assert kv.expire_pins() == 1


def test_over_the_cap_the_least_recently_refreshed_pin_lapses():
    kv = manager(num_blocks=8, fraction=0.5)  # at most 4 pinned blocks
    first = cache_prompt(kv, "a", list(range(100, 112)))  # 3 blocks
    second = cache_prompt(kv, "b", list(range(200, 208)))  # 2 blocks
    assert kv.pin(first, 12, ttl_s=300) == 3
    assert kv.pin(second, 8, ttl_s=300) == 2
    stats = kv.pin_stats()
    assert stats.num_pins == 1 and stats.num_pinned_blocks == 2 and stats.pins_lapsed == 1
    assert kv.pin(cache_prompt(kv, "c", list(range(300, 320))), 20, ttl_s=300) == 0  # 5 blocks: over the cap
    kv.check_integrity()


def test_nested_pins_share_blocks():
    kv = manager(num_blocks=8)
    chain = cache_prompt(kv, "a", list(range(100, 112)))
    kv.pin(chain, 4, ttl_s=300)
    kv.pin(chain, 12, ttl_s=3600)
    assert kv.pool.num_pinned_blocks == 3 and kv.pool.blocks[kv.pool.cached_block(chain.hashes[0]).block_id].pin_count == 2
    kv.check_integrity()


def test_integrity_catches_a_pin_count_out_of_step_and_a_missed_sweep():
    clock = FakeClock()
    kv = manager(num_blocks=8, clock=clock)
    chain = cache_prompt(kv, "a", list(range(100, 108)))
    kv.pin(chain, 8, ttl_s=10)
    kv.pool.cached_block(chain.hashes[0]).pin_count += 1
    with pytest.raises(KVIntegrityError, match="pin_count"):
        kv.pins.check_integrity()
    kv.pool.cached_block(chain.hashes[0]).pin_count -= 1
    clock.now += 20
    kv.pins._last_sweep = clock.now  # a sweep that forgot to drop the expired pin
    with pytest.raises(KVIntegrityError, match="expired"):
        kv.pins.check_integrity()


def test_without_prefix_caching_nothing_is_pinned():
    kv = KVCacheManager(8, BS, enable_caching=False)
    assert kv.pin(block_hashes(list(range(8)), BS), 8, ttl_s=300) == 0


def test_cache_write_tokens_counts_whole_blocks_not_already_cached():
    assert cache_write_tokens(breakpoint_tokens=35, num_cached_tokens=0, block_size=16) == 32
    assert cache_write_tokens(breakpoint_tokens=35, num_cached_tokens=16, block_size=16) == 16
    assert cache_write_tokens(breakpoint_tokens=35, num_cached_tokens=48, block_size=16) == 0
