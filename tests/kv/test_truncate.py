"""KVCacheManager.truncate: a request's KV cut back (rejected draft tokens, a retokenized tail)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.pool.block_updates import NULL_BLOCK_ID
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager

BS = 4


def manager(num_blocks=32, windows=(None,)):
    return KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=True, group_windows=windows)


def compute(kv, request_id, tokens, computed):
    chain = block_hashes(tokens, BS)
    if not kv.num_blocks_held(request_id):
        assert kv.allocate_slots(request_id, computed, prefix=kv.find_cached_prefix(tokens, chain))
    else:
        assert kv.allocate_slots(request_id, computed)
    kv.cache_full_blocks(request_id, tokens, chain, computed)
    kv.free_behind_window(request_id, computed)
    kv.check_tables(request_id, computed)
    kv.check_integrity()
    return chain


def table(kv, request_id, group=0):
    return [kv.pool.blocks[block_id] for block_id in kv.block_ids(request_id)[group] if block_id != NULL_BLOCK_ID]


def test_a_draft_spilling_into_a_new_block_then_rejected_returns_that_block():
    kv = manager()
    tokens = list(range(1, 8))
    compute(kv, "a", tokens, 7)  # blocks 0-1, block 1 holds 3 tokens
    free_before = kv.num_free_blocks
    assert kv.allocate_slots("a", 7 + 3)  # three draft tokens: the last two spill into block 2
    spilled = kv.block_ids("a")[0][2]
    assert kv.num_free_blocks == free_before - 1
    assert kv.truncate("a", 7) == 7  # every draft rejected
    assert kv.block_ids("a")[0] == kv.block_ids("a")[0][:2] and len(kv.block_ids("a")[0]) == 2
    assert kv.num_free_blocks == free_before
    assert spilled in [block.block_id for block in kv.pool.free_queue]
    kv.check_tables("a", 7)
    kv.check_integrity()


def test_nothing_is_hashed_past_the_cut_and_the_cut_block_is_cached_again_with_its_new_tokens():
    kv = manager()
    tokens = list(range(1, 14))
    compute(kv, "a", tokens, 13)  # blocks 0-2 cached, block 3 holds one token
    assert all(block.block_hash is not None for block in table(kv, "a")[:3])
    assert kv.truncate("a", 6) == 6  # inside block 1
    held = table(kv, "a")
    assert len(held) == 2 and held[0].block_hash is not None and held[1].block_hash is None
    assert kv.num_cached_blocks == 2  # blocks 0 and 2; block 2 went back to the pool still cached
    assert kv.pending_block_keys("a", block_hashes(tokens, BS), 8) == {block_hashes(tokens, BS).hashes[1]}
    kv.check_integrity()
    retokenized = tokens[:6] + [90, 91, 92]
    chain = compute(kv, "a", retokenized, 9)
    assert table(kv, "a")[1].block_hash == chain.hashes[1]  # recomputed: cached under its new content
    match = kv.find_cached_prefix(retokenized + [0], block_hashes(retokenized + [0], BS))
    assert match.num_tokens == 8
    assert kv.find_cached_prefix(tokens, block_hashes(tokens, BS)).num_tokens == 4  # the old block 1 is gone
    kv.check_integrity()


def test_a_cut_at_a_block_boundary_keeps_every_block_before_it_cached():
    kv = manager()
    tokens = list(range(1, 14))
    compute(kv, "a", tokens, 13)
    assert kv.truncate("a", 8) == 8
    assert [block.block_hash is not None for block in table(kv, "a")] == [True, True]
    assert kv.pending_block_keys("a", block_hashes(tokens, BS), 13) == set(block_hashes(tokens, BS).hashes[2:3])
    kv.check_integrity()


def test_a_cut_inside_a_block_another_request_shares_stops_at_its_start():
    kv = manager()
    tokens = list(range(1, 14))
    compute(kv, "a", tokens, 13)
    compute(kv, "b", tokens, 13)  # shares blocks 0-2 with "a"
    shared = table(kv, "b")[1]
    assert shared.ref_cnt == 2
    assert kv.truncate("b", 6) == 4  # block 1 is not rewritten under "a": recompute from token 4
    assert len(kv.block_ids("b")[0]) == 1
    assert shared.ref_cnt == 1 and shared.block_hash is not None  # still "a"'s, still cached
    assert kv.find_cached_prefix(tokens, block_hashes(tokens, BS)).num_tokens == 12
    kv.check_integrity()


def test_a_pinned_block_the_cut_falls_inside_lapses_its_pin():
    kv = manager()
    tokens = list(range(1, 14))
    chain = compute(kv, "a", tokens, 13)
    assert kv.pin(chain, 12, 300.0) == 3
    assert kv.truncate("a", 10) == 10  # inside block 2, pinned
    assert kv.pin_stats().num_pins == 0
    kv.check_integrity()


def test_windowed_groups_cut_within_what_their_window_still_holds():
    kv = manager(windows=(None, 6))
    tokens = list(range(1, 30))
    compute(kv, "a", tokens, 28)  # the window of position 28 starts in block 5: blocks 0-4 freed
    assert kv.block_ids("a")[1][:5] == [NULL_BLOCK_ID] * 5
    assert kv.truncate("a", 26) == 26  # the window of position 26 starts in block 5 too
    assert [len(ids) for ids in kv.block_ids("a")] == [7, 7]
    assert all(block.block_hash is None for group in (0, 1) for block in table(kv, "a", group)[-1:])
    kv.check_tables("a", 26)
    kv.check_integrity()
    compute(kv, "a", tokens, 28)  # recomputed: cached again
    assert all(block.block_hash is not None for group in (0, 1) for block in table(kv, "a", group)[-1:])


def test_a_cut_behind_what_a_window_freed_drops_everything():
    kv = manager(windows=(None, 6))
    tokens = list(range(1, 30))
    compute(kv, "a", tokens, 28)
    assert kv.truncate("a", 22) == 0  # its window starts in block 4, freed: nothing later can be recomputed
    assert kv.block_ids("a") == [[], []] and kv.num_blocks_held("a") == 0
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
    compute(kv, "a", tokens[:23], 22)  # from scratch, prefix hits allowed
    kv.free("a")
    kv.check_integrity()


def test_truncating_past_the_tables_is_an_error():
    kv = manager()
    compute(kv, "a", list(range(1, 8)), 7)
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate("a", 9)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([(1,) * 9, (1, 2) * 5]),
                          st.lists(st.integers(1, 3), max_size=6), st.integers(0, 16),
                          st.lists(st.integers(1, 3), max_size=6)), max_size=30))
def test_a_block_is_only_ever_cached_under_the_tokens_every_holder_has(ops):
    """Requests share blocks (two common prefixes); a held one is cut back and its tail retokenized: every
    hashed block any table holds still carries exactly that table's tokens at its place."""
    kv = manager(num_blocks=24, windows=(None,))
    held: dict[str, list[int]] = {}
    for rid, prefix, rest, cut, tail in ops:
        request_id, tokens = f"r{rid}", list(prefix) + rest
        if request_id in held:
            tokens = held[request_id]
            kept = kv.truncate(request_id, min(cut, len(tokens)))
            assert kept <= min(cut, len(tokens))
            tokens = tokens[:kept] + tail
            if tokens and kv.allocate_slots(request_id, len(tokens)):
                kv.cache_full_blocks(request_id, tokens, block_hashes(tokens, BS), len(tokens))
                held[request_id] = tokens
            else:
                kv.free(request_id)
                held.pop(request_id)
        else:
            chain = block_hashes(tokens, BS)
            if kv.allocate_slots(request_id, len(tokens), prefix=kv.find_cached_prefix(tokens, chain)):
                kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
                held[request_id] = tokens
        kv.check_integrity()
        for request_id, tokens in held.items():
            for index, block in enumerate(table(kv, request_id)):
                if block.block_hash is not None:
                    assert block.token_ids == tuple(tokens[index * BS : (index + 1) * BS])
    for request_id in held:
        kv.free(request_id)
    kv.check_integrity()
