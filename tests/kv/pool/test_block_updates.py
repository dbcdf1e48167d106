"""KVCacheManager.take_block_updates: what the runner's persistent block table applies each step."""

import random

import pytest

from kvserve.kv.pool.block_updates import NULL_BLOCK_ID, BlockTableUpdate
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager

BS = 4


class RunnerTable:
    """The runner's side: a persistent table per group, updated only through BlockTableUpdates."""

    def __init__(self):
        self.tables = None

    def apply(self, update: BlockTableUpdate) -> None:
        if update.replace:
            self.tables = [list(ids) for ids in update.block_ids]
        else:
            assert self.tables is not None, "an append before any replacement"
            for table, added in zip(self.tables, update.block_ids):
                table.extend(added)


def sync(kv, request_id, runner):
    update = kv.take_block_updates(request_id)
    runner.apply(update)
    assert runner.tables == kv.block_ids(request_id)
    return update


def test_the_first_update_replaces_then_appends_carry_only_the_new_blocks():
    kv = KVCacheManager(16, BS, watermark=0.0)
    runner = RunnerTable()
    assert kv.allocate_slots("a", 5)
    first = sync(kv, "a", runner)
    assert first.replace and first.block_ids == (tuple(kv.block_ids("a")[0]),) and len(first.block_ids[0]) == 2
    assert sync(kv, "a", runner) == BlockTableUpdate(False, ((),))  # nothing changed
    assert kv.allocate_slots("a", 6)
    assert sync(kv, "a", runner) == BlockTableUpdate(False, ((),))  # still two blocks
    assert kv.allocate_slots("a", 13)
    update = sync(kv, "a", runner)
    assert not update.replace and update.block_ids == (tuple(kv.block_ids("a")[0][2:]),)
    assert len(update.block_ids[0]) == 2


def test_free_forgets_the_request_and_a_prefix_hit_replaces():
    kv = KVCacheManager(16, BS, watermark=0.0, enable_caching=True)
    runner = RunnerTable()
    tokens = list(range(1, 14))
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots("a", 13)
    kv.cache_full_blocks("a", tokens, chain, 13)
    sync(kv, "a", runner)
    kv.free("a")  # preempted
    assert kv.take_block_updates("a") == BlockTableUpdate(True, ((),))
    match = kv.find_cached_prefix(tokens, chain)
    assert match.num_tokens == 12
    assert kv.allocate_slots("a", 13, prefix=match)
    assert sync(kv, "a", runner).replace


def test_a_prefix_hit_after_an_empty_update_still_replaces():
    kv = KVCacheManager(16, BS, watermark=0.0, enable_caching=True)
    tokens = list(range(1, 14))
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots("a", 13)
    kv.cache_full_blocks("a", tokens, chain, 13)
    runner = RunnerTable()
    sync(kv, "b", runner)  # asked before it holds anything
    assert kv.allocate_slots("b", 13, prefix=kv.find_cached_prefix(tokens, chain))
    assert sync(kv, "b", runner).replace


def test_a_shift_and_a_truncation_replace_the_table():
    kv = KVCacheManager(16, BS, watermark=0.0, enable_caching=True)
    runner = RunnerTable()
    assert kv.allocate_slots("a", 16)
    sync(kv, "a", runner)
    assert kv.shift("a", 2, 7, 16) is not None
    assert sync(kv, "a", runner).replace
    assert kv.truncate("a", 5) == 5
    assert sync(kv, "a", runner).replace
    assert kv.truncate("a", 5) == 5  # nothing to drop
    assert not sync(kv, "a", runner).replace


def test_blocks_freed_behind_a_window_replace_with_null_ids():
    kv = KVCacheManager(40, BS, watermark=0.0, group_windows=(None, 6))
    runner = RunnerTable()
    replaced = []
    for computed in range(1, 41):
        assert kv.allocate_slots("a", computed)
        kv.free_behind_window("a", computed)
        replaced.append(sync(kv, "a", runner).replace)
    assert NULL_BLOCK_ID in runner.tables[1] and NULL_BLOCK_ID not in runner.tables[0]
    # The first update and each block the window lets go of: 1 + (40 - 5) // 4 of 40 updates.
    assert sum(replaced) == 1 + (40 - 5) // BS


@pytest.mark.parametrize("windows", [(None,), (None, 6), (5,)])
@pytest.mark.parametrize("seed", range(4))
def test_a_table_rebuilt_update_by_update_always_equals_block_ids(windows, seed):
    rng = random.Random(seed)
    kv = KVCacheManager(48, BS, watermark=0.0, enable_caching=True, group_windows=windows)
    prompts = [[rng.randrange(1, 4) for _ in range(rng.randrange(6, 30))] for _ in range(3)]
    requests = {}  # id -> (tokens, computed)
    runners = {f"r{i}": RunnerTable() for i in range(3)}
    for _ in range(200):
        request_id = rng.choice(sorted(runners))
        tokens, computed = requests.get(request_id, (None, 0))
        op = rng.random()
        if tokens is None:
            tokens = list(rng.choice(prompts)) + [rng.randrange(5, 9) for _ in range(20)]
            chain = block_hashes(tokens, BS)
            match = kv.find_cached_prefix(tokens[:20], chain)
            if kv.allocate_slots(request_id, max(match.num_tokens, 1) + 1, prefix=match):
                requests[request_id] = (tokens, max(match.num_tokens, 1) + 1)
        elif op < 0.15 or computed >= len(tokens):
            kv.free(request_id)
            requests.pop(request_id)
        elif op < 0.3 and windows == (None,) and computed > 4:
            keep, drop = 1, rng.randrange(1, computed - 2)
            if kv.shift(request_id, keep, drop, computed) is not None:
                tokens = tokens[:keep] + tokens[keep + drop :]
                requests[request_id] = (tokens, computed - drop)
        elif op < 0.45 and computed > 1:
            kept = kv.truncate(request_id, rng.randrange(0, computed))
            requests[request_id] = (tokens, kept)
        else:
            grown = min(computed + rng.randrange(1, 6), len(tokens))
            if kv.allocate_slots(request_id, grown):
                kv.cache_full_blocks(request_id, tokens, block_hashes(tokens, BS), grown)
                kv.free_behind_window(request_id, grown)
                requests[request_id] = (tokens, grown)
        if rng.random() < 0.7:
            sync(kv, request_id, runners[request_id])
        kv.check_integrity()
    for request_id, runner in runners.items():
        sync(kv, request_id, runner)
        kv.free(request_id)
    assert kv.num_free_blocks == kv.num_blocks
