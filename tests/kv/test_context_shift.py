"""The context shift's amount (llama.cpp's n_discard) and plan over a full-attention table."""

import pytest

from kvserve.kv.context_shift import shift_amount
from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager

BS = 4


@pytest.mark.parametrize("keep_tokens, num_tokens, expected", [
    (0, 10, (0, 4)),  # drop half of what follows the last token's predecessor
    (4, 10, (4, 2)),
    (8, 10, (8, 1)),  # at least one
    (20, 10, (8, 1)),  # keep at most all but two
    (0, 2, (0, 1)),
])
def test_shift_amount_keeps_the_first_tokens_and_drops_half_of_the_rest(keep_tokens, num_tokens, expected):
    assert shift_amount(keep_tokens, num_tokens) == expected


def test_shift_amount_always_leaves_room_and_a_token_to_compute():
    for num_tokens in range(2, 40):
        for keep_tokens in range(0, 40):
            keep, drop = shift_amount(keep_tokens, num_tokens)
            assert 0 <= keep <= num_tokens - 2 and drop >= 1 and keep + drop < num_tokens


def test_a_shift_moves_later_rows_and_never_caches_shifted_blocks():
    kv = KVCacheManager(16, BS, watermark=0.0, enable_caching=True)
    tokens = list(range(1, 17))
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots("a", 16)
    kv.cache_full_blocks("a", tokens, chain, 16)
    before = kv.block_ids("a")[0]
    plan = kv.shift("a", 5, 6, 16)  # tokens 5-10 go; 11-15 move to 5-9
    assert plan is not None and plan.drop == 6
    assert kv.block_ids("a")[0] == before[:3] and kv.num_free_blocks == 16 - 3
    moved = list(zip(plan.moved.src_blocks, plan.moved.src_rows, plan.moved.dst_blocks, plan.moved.dst_rows))
    assert moved[0] == (before[2], 3, before[1], 1) and len(moved) == 5
    assert kv.num_cached_blocks == 2  # block 0 kept; blocks 1-2 rewritten in place: uncached; block 3 freed, still cached
    shifted = tokens[:5] + tokens[11:]
    kv.cache_full_blocks("a", shifted, block_hashes(shifted, BS), 12)
    assert kv.num_cached_blocks == 2  # nothing from block 1 on is cached for this request again
    kv.check_integrity()
