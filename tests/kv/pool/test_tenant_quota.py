"""Per-tenant shares of the KV pool: a tenant's cached blocks up to its share survive another tenant's flood,
eviction takes from the tenant furthest over its share first, pins count against their owner, and one
tenant alone is the plain LRU pool it always was."""

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool.block_pool import BlockPool
from tests.engine.test_fair_share import add
from tests.engine.test_scheduler import counts, step


def cache_blocks(pool, tenant, count, first_hash):
    """`count` blocks allocated by `tenant`, cached under fresh hashes and freed (an idle tenant's prefix)."""
    blocks = pool.allocate(count, tenant)
    for i, block in enumerate(blocks):
        pool.cache_block(block, first_hash + i, None, (first_hash + i,), 0)
    pool.free(reversed(blocks))
    return blocks


def test_one_tenant_is_plain_lru():
    pool = BlockPool(4)
    cached = cache_blocks(pool, "A", 4, 100)
    taken = pool.allocate(2, "A")
    assert taken == [cached[3], cached[2]]  # freed tail first: the free queue's head
    assert pool.quota.protected("A") == 0
    pool.check_integrity()


def test_an_idle_tenants_prefix_within_its_share_is_not_free_to_a_flooding_tenant():
    pool = BlockPool(10)
    b_blocks = cache_blocks(pool, "B", 3, 100)  # B's prefix: 3 blocks, under its share (5 of 10)
    a_running = pool.allocate(6, "A")  # A now holds 6, over its share
    assert pool.num_free_blocks == 4 and pool.num_free_for("A") == 1  # only the never-used block
    assert pool.num_free_for("B") == 4
    taken = pool.allocate(1, "A")
    assert taken[0] not in b_blocks and all(block.block_hash is not None for block in b_blocks)
    pool.free(reversed(a_running + taken))
    pool.check_integrity()


def test_eviction_takes_from_the_tenant_furthest_over_its_share():
    pool = BlockPool(10)
    b_blocks = cache_blocks(pool, "B", 2, 100)
    a_blocks = cache_blocks(pool, "A", 8, 200)  # A: 8 of 10, furthest over; B's are older (LRU head)
    taken = pool.allocate(3, "C")
    assert all(block in a_blocks for block in taken)
    assert all(block.block_hash is not None for block in b_blocks)
    pool.check_integrity()


def test_pins_count_against_their_owner():
    pool = BlockPool(10)
    b_blocks = cache_blocks(pool, "B", 4, 100)
    for block in b_blocks:
        pool.pin(block)
    pool.allocate(6, "A")
    assert pool.quota.held["B"] == 4 and pool.num_free_for("A") == 0
    pool.check_integrity()


def make_scheduler(num_blocks, block_size=4):
    config = EngineConfig(block_size=block_size, max_num_batched_tokens=64)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, watermark=0.0, enable_caching=True))


@pytest.mark.parametrize("flood_tokens", [48, 72])  # A's requests: 12 blocks, or 18 (one alone is under its share)
def test_a_tenants_cached_prefix_survives_anothers_flood_in_the_scheduler(flood_tokens):
    """Two tenants, one flooding: the other's repeated prompt keeps hitting its cached prefix, whether the
    flooder is over its share or, one request at a time, under it."""
    scheduler = make_scheduler(num_blocks=40)
    b_prompt = dict(prompt_len=40, tenant="B", first_token=500)  # 10 blocks, its share is 20
    add(scheduler, "b0", max_tokens=1, **b_prompt)
    while scheduler.has_unfinished():
        step(scheduler)
    for i in range(12):  # A's flood: far more than the pool, in unique prompts
        add(scheduler, f"a{i}", flood_tokens, "A", max_tokens=2, first_token=1000 + 100 * i)
    for round_ in range(3):
        for _ in range(6):
            step(scheduler)
        b = add(scheduler, f"b{round_ + 1}", max_tokens=1, **b_prompt)
        assert scheduler.kv.match_prefix(b.all_token_ids, b.block_hashes).num_tokens == 36  # (the last block is always computed)
        step(scheduler)
        assert b.num_cached_tokens == 36, f"round {round_}: B's prefix was evicted"  # all but the last block
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_without_shares_the_flood_would_evict_it():
    """The same flood by one tenant (as before tenants had shares) evicts the prefix: the test above can fail."""
    scheduler = make_scheduler(num_blocks=40)
    add(scheduler, "b0", 40, "A", max_tokens=1, first_token=500)
    while scheduler.has_unfinished():
        step(scheduler)
    for i in range(12):
        add(scheduler, f"a{i}", 48, "A", max_tokens=2, first_token=1000 + 100 * i)
    for _ in range(6):
        step(scheduler)
    b = add(scheduler, "b1", 40, "A", max_tokens=1, first_token=500)
    assert scheduler.kv.match_prefix(b.all_token_ids, b.block_hashes).num_tokens == 0




def test_a_tenant_with_nothing_running_always_gets_in():
    """Shares never hang a request: one that needs more than the blocks outside another tenant's share is
    admitted once its own tenant has nothing running (evicting what it must, its own first)."""
    scheduler = make_scheduler(num_blocks=10)
    add(scheduler, "b0", 16, "B", max_tokens=1, first_token=500)  # B caches 4 blocks, within its share of 5
    add(scheduler, "a_old", 24, "A", max_tokens=1, first_token=2000)  # A caches 6: over its share
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.kv.pool.num_free_for("A") == 6
    a = add(scheduler, "a0", 32, "A", max_tokens=1, first_token=1000)  # needs 8 blocks: 6 are not B's
    for _ in range(20):
        step(scheduler)
        if not scheduler.has_unfinished():
            break
    assert a.finished
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_a_tenant_under_its_share_takes_blocks_back_from_the_one_over_it():
    """B (its prefix cached, under its share) arrives while A's running requests hold every other block: B
    does not wait for them to finish; A's most recent request is preempted and B runs in the next step."""
    scheduler = make_scheduler(num_blocks=40)
    add(scheduler, "b0", 40, "B", max_tokens=1, first_token=500)
    while scheduler.has_unfinished():
        step(scheduler)
    for i in range(3):
        add(scheduler, f"a{i}", 32, "A", max_tokens=30, first_token=1000 + 100 * i)
    for _ in range(7):
        step(scheduler)
    assert scheduler.kv.num_free_blocks == 10 and len(scheduler.running) == 3  # all but B's prefix is A's
    b = add(scheduler, "b1", 41, "B", max_tokens=1, first_token=500)
    out = step(scheduler)
    assert out.preempted and all(rid.startswith("a") for rid in out.preempted)
    assert b.num_cached_tokens == 40 and "b1" in counts(out)
