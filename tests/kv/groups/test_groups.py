"""KV groups: the layout, and the manager's tables per group with windows that free blocks."""

import pytest

from kvserve.errors import KVIntegrityError
from kvserve.kv.groups.layout import blocks_held, first_needed_block, kv_group_layout, max_blocks_held
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.pool.block_updates import NULL_BLOCK_ID
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.cache.kv_spec import KVSpec

BS = 4


def test_layout_cuts_each_kind_into_groups_of_equal_layers():
    gemma = kv_group_layout(((512,) * 5 + (None,)) * 3)  # Gemma 3 270M: 18 layers, every sixth global
    assert gemma.page_layers == 3 and gemma.num_groups == 6
    assert gemma.windows == (512,) * 5 + (None,)
    assert gemma.groups[0].layers == (0, 1, 2) and gemma.groups[1].layers == (3, 4, 6)
    assert gemma.groups[5].layers == (5, 11, 17)
    assert gemma.layer_group[11] == 5 and gemma.layer_slot[11] == 1
    assert gemma.describe() == "6 groups of 3 layers: 5 windowed (512 tokens), 1 full attention"
    llama = kv_group_layout((None,) * 30)
    assert (llama.num_groups, llama.page_layers, llama.layer_slot) == (1, 30, tuple(range(30)))
    assert kv_group_layout((8, 8, 8)).windows == (8,)  # Mistral: one windowed group
    odd = kv_group_layout((None, 5, None))
    assert odd.page_layers == 1 and odd.num_groups == 3


def test_spec_pages_and_request_bytes():
    spec = KVSpec(18, 1, 256, "float32", ((512,) * 5 + (None,)) * 3)
    per_layer = 2 * 256 * 4
    assert spec.bytes_per_token == 18 * per_layer and spec.page_bytes(16) == 16 * 3 * per_layer
    # 4,096 tokens: the full group holds 256 blocks, each windowed group the blocks of its last 511 positions.
    windowed = blocks_held(512, 4096, 16)
    assert windowed == 4096 // 16 - (4096 - 511) // 16 == 32
    assert spec.request_bytes(4096, 16) == (256 + 5 * windowed) * spec.page_bytes(16)
    assert spec.request_bytes(4096, 16) < 4096 * spec.bytes_per_token
    assert KVSpec(30, 3, 64, "float32").request_bytes(37, 16) == 48 * KVSpec(30, 3, 64, "float32").bytes_per_token


@pytest.mark.parametrize("window", [1, 4, 5, 6, 9])
def test_blocks_held_never_exceed_the_window_bound(window):
    for tokens in range(1, 80):
        held = blocks_held(window, tokens, BS)
        assert held <= max_blocks_held(window, BS) <= -(-window // BS) + 1
        # Exactly the blocks a query at position `tokens` still reads, among those computed.
        assert held == len(range(first_needed_block(window, tokens, BS), -(-tokens // BS)))


def manager(num_blocks=40, windows=(None, 6), caching=True):
    return KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=caching, group_windows=windows)


def advance(kv, request_id, tokens, computed):
    """What a step does for the manager: cover the tokens, cache the full blocks, free behind windows."""
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots(request_id, computed)
    kv.cache_full_blocks(request_id, tokens, chain, computed)
    kv.free_behind_window(request_id, computed)
    kv.check_tables(request_id, computed)
    kv.check_integrity()


def test_a_windowed_group_frees_blocks_behind_its_window_as_a_request_advances():
    kv = manager()
    tokens = list(range(100, 140))
    for computed in range(1, 41):
        advance(kv, "a", tokens, computed)
        full, windowed = kv.blocks_held_by_group("a")
        assert full == -(-computed // BS) and windowed == blocks_held(6, computed, BS) <= max_blocks_held(6, BS)
    full_table, window_table = kv.block_ids("a")
    assert NULL_BLOCK_ID not in full_table and window_table[:8] == [NULL_BLOCK_ID] * 8
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_hit_needs_every_full_block_but_only_the_window_of_a_windowed_group():
    kv = manager()
    tokens = list(range(100, 140))  # 10 blocks
    advance(kv, "a", tokens, 40)
    kv.free("a")
    # Every full block is cached; the windowed group's blocks 0..7 were freed while cached, so they are too.
    match = kv.find_cached_prefix(tokens + [1], block_hashes(tokens + [1], BS))
    assert match.num_tokens == 40
    # The hit needs the windowed group's blocks from the one holding position 40 - 6 + 1 = 35 (block 8) on.
    assert match.tables[1][:8] == (None,) * 8 and None not in match.tables[1][8:]
    assert None not in match.tables[0]


def test_a_hit_never_reuses_a_freed_window_block_that_is_gone():
    kv = manager(num_blocks=21)
    tokens = list(range(100, 140))
    advance(kv, "a", tokens, 40)  # holds 10 full + 2 windowed blocks; 8 windowed ones are free but cached
    kv.free("a")
    # Another request takes 9 blocks from the free queue's head: the windowed group's oldest cached blocks.
    assert kv.allocate_slots("other", 18)
    kv.check_integrity()
    chain = block_hashes(tokens + [1], BS)
    match = kv.find_cached_prefix(tokens + [1], chain)
    window_blocks = [b for b in match.tables[1] if b is not None]
    assert all(b.block_hash == chain.hashes[i] for i, b in enumerate(match.tables[1]) if b is not None)
    # Wherever the hit ends, the windowed group has the blocks its window needs there, and only cached ones.
    first = first_needed_block(6, match.num_tokens, BS)
    assert len(window_blocks) == match.num_tokens // BS - first
    assert all(b.block_hash is not None for b in match.blocks)


def test_the_hybrid_search_backs_off_to_where_every_group_has_its_blocks():
    kv = manager(windows=(None, 6, 6))
    tokens = list(range(200, 232))  # 8 blocks
    advance(kv, "a", tokens, 32)
    kv.free("a")
    # Evict block 6 of the first windowed group and block 4 of the second.
    pool = kv.pool
    chain = block_hashes(tokens + [7], BS)
    for index, group in ((6, 1), (4, 2)):
        block = pool.cached_block(chain.hashes[index], group)
        pool._evict(block)  # as allocation would, keeping the counts (the pool's and its owner's)
        pool.num_cached_free_blocks -= 1
        pool.quota.cached_free[block.tenant] -= 1
    match = kv.find_cached_prefix(tokens + [7], chain)
    # A hit of n blocks needs blocks (4n - 5) // 4 .. n - 1 of each windowed group: n = 8 and 7 need block 6
    # of group 1; n = 6 and 5 need block 4 of group 2; n = 4 needs blocks 2 and 3 only.
    assert match.num_tokens == 4 * BS
    kv.check_integrity()


def test_tables_that_lost_a_block_their_next_query_reads_fail_the_check():
    kv = manager()
    tokens = list(range(100, 120))
    advance(kv, "a", tokens, 20)
    kv.groups[1].tables["a"][-1] = None  # corrupt: the windowed group's newest block is gone
    with pytest.raises(KVIntegrityError, match="lost a block"):
        kv.check_tables("a", 20)


def test_peak_blocks_count_the_window_plus_a_chunk_not_the_whole_context():
    kv = manager(num_blocks=100, windows=(6,))
    # 1,000 tokens in chunks of at most 16: a windowed group never holds more than (6 - 1 + 16) / 4 + 1 blocks.
    assert kv.peak_blocks(1000, 16) == 7 and kv.can_fit(1000, 16)
    assert kv.peak_blocks(1000) == 250 and not manager(num_blocks=100, windows=(None,)).can_fit(1000, 16)


def test_a_pin_covers_what_a_hit_at_its_breakpoint_needs_in_every_group():
    kv = manager()
    tokens = list(range(100, 140))
    advance(kv, "a", tokens, 40)
    kv.free("a")
    # A hit at 32 tokens reads all 8 full-attention blocks and the windowed blocks of positions 27..31 (6, 7).
    assert kv.pin(block_hashes(tokens, BS), 32, ttl_s=60) == 8 + 2
    kv.check_integrity()
    pinned = [block for block in kv.pool.blocks if block.pin_count]
    assert sorted((b.group, b.token_ids[0]) for b in pinned if b.group == 1) == [(1, 124), (1, 128)]
    # Under pressure every unpinned block goes first; the pinned prefix is still a hit afterwards.
    assert kv.allocate_slots("other", (kv.num_free_blocks - 10) // 2 * BS)  # two groups: two blocks a position
    match = kv.find_cached_prefix(tokens[:32] + [1], block_hashes(tokens[:32] + [1], BS))
    assert match.num_tokens == 32
