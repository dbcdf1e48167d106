"""A compressing request's tables beside windowed groups (kv/compressed_tables.py): only the full-attention group
compacts and counts slots; the windowed group keeps its tables by position; cuts and checks agree per group."""

from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.manager import KVCacheManager

BS = 4
WINDOWS = (8, None)  # a windowed group, then a full-attention one


def manager(num_blocks=64):
    kv = KVCacheManager(num_blocks, BS, watermark=0.0, enable_caching=True, group_windows=WINDOWS)
    kv.set_compression("r", ChunkPolicy(16, 4, 4, 60))  # 3 chunks compressed, 12 of every 16 tokens dropped
    return kv


def step(kv, computed, count):
    assert kv.allocate_slots("r", computed + count)
    kv.free_behind_window("r", computed + count)
    kv.check_tables("r", computed + count)
    kv.check_integrity()


def test_only_the_full_attention_group_compacts_and_counts_slots():
    kv = manager()
    for computed in range(0, 48, 16):
        step(kv, computed, 16)
    step(kv, 48, 12)  # chunk 2 compacted before the tail is computed
    compactions = kv.take_compactions("r")
    assert [(c.chunk_index, c.group, len(c.src_blocks), c.num_kept_blocks) for c in compactions] == [
        (0, 1, 4, 1), (1, 1, 4, 1), (2, 1, 4, 1)]
    assert kv.slot_offsets("r") == (0, 36)
    windowed, full = (len(table) for table in kv.block_ids("r"))
    assert (windowed, full) == (15, 15 - 36 // BS)  # positions 0..59, and 60 - 36 = 24 slots
    assert kv.blocks_held_by_group("r") == [2, 6]  # the window of position 60 (53..59: blocks 13, 14), the slots


def test_a_cut_in_the_tail_cuts_each_group_in_its_own_coordinates():
    kv = manager()
    for computed in range(0, 48, 16):
        step(kv, computed, 16)
    assert kv.allocate_slots("r", 64)  # the prompt's tail and drafts, 7 of them rejected (the scheduler cuts
    assert kv.truncate("r", 57) == 57  # before it frees behind the window)
    kv.check_tables("r", 57)
    kv.check_integrity()
    assert [len(table) for table in kv.block_ids("r")] == [15, 6]  # ceil(57 / 4), ceil((57 - 36) / 4)
    kv.free("r")
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_cut_into_a_compressed_chunk_starts_the_request_again():
    kv = manager()
    for computed in range(0, 48, 16):
        step(kv, computed, 16)
    step(kv, 48, 12)
    assert kv.truncate("r", 60) == 60
    # The windowed group let go of the blocks before its window: nothing before them can be resumed, and a
    # compressed chunk cannot be cut into: back to 0, uncompressed, with every block returned.
    assert kv.truncate("r", 30) == 0
    assert kv.slot_offsets("r") == (0, 0) and kv.num_free_blocks == kv.num_blocks
    step(kv, 0, 16)
