"""Block pool and manager invariants under random operation sequences (hypothesis)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.errors import KVIntegrityError
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import FreeBlockQueue, KVBlock
from kvserve.kv.manager import KVCacheManager


def test_free_queue_removes_from_the_middle_in_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2] and len(queue) == 4
    with pytest.raises(ValueError):
        queue.remove(blocks[0])  # not in the queue


def test_pool_frees_to_the_tail_and_refuses_double_free():
    pool = BlockPool(4)
    taken = pool.allocate(3)
    pool.free(reversed(taken))
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1, 0]
    with pytest.raises(ValueError):
        pool.free([taken[0]])
    with pytest.raises(ValueError):
        pool.allocate(5)
    pool.check_integrity()


def test_manager_allocates_per_block_and_frees_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    assert manager.allocate_slots("a", 5)  # 2 blocks
    assert manager.block_ids("a")[0] == [0, 1]
    assert manager.allocate_slots("a", 8)  # still 2
    assert manager.allocate_slots("a", 9)  # a third
    assert manager.num_used_blocks == 3
    manager.free("a")
    assert [b.block_id for b in manager.pool.free_queue][-3:] == [2, 1, 0]
    manager.check_integrity()


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    assert manager.allocate_slots("a", 12)
    assert not manager.allocate_slots("b", 8)
    assert manager.block_ids("b")[0] == [] and manager.num_free_blocks == 1
    assert not manager.allocate_slots("a", 24)
    assert len(manager.block_ids("a")[0]) == 3
    manager.check_integrity()


def test_watermark_applies_to_admissions_only():
    manager = KVCacheManager(num_blocks=100, block_size=1, watermark=0.05)
    assert manager.allocate_slots("a", 95)
    assert not manager.allocate_slots("b", 1, keep_watermark=True)
    assert manager.allocate_slots("a", 100)  # a running request may use the reserve


def test_corruption_raises_kv_integrity_error():
    pool = BlockPool(4)
    pool.free_queue.popleft().ref_cnt = 0  # out of the queue, yet held by nobody: a leak
    with pytest.raises(KVIntegrityError, match="neither free nor referenced"):
        pool.check_integrity()
    manager = KVCacheManager(num_blocks=4, block_size=4)
    assert manager.allocate_slots("a", 5)
    manager.pool.blocks[0].ref_cnt = 2  # one table holds it
    with pytest.raises(KVIntegrityError, match="ref_cnt 2, held by 1"):
        manager.check_integrity()


def test_integrity_errors_survive_python_O():
    """`python -O` strips asserts; the integrity checks must still raise."""
    code = ("from kvserve.errors import KVIntegrityError; from kvserve.kv.pool.block_pool import BlockPool\n"
            "assert False, 'asserts are on'\n"
            "pool = BlockPool(4); pool.blocks[1].ref_cnt = 3\n"
            "try:\n    pool.check_integrity()\nexcept KVIntegrityError as exc:\n    print('raised:', exc)\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-O", "-c", code], env={**os.environ, "PYTHONPATH": str(root)}, cwd=root,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "raised: free block 1 has ref_cnt 3"


operations = st.lists(
    st.tuples(st.sampled_from(["allocate", "append", "free"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=operations)
def test_invariants_hold_under_random_operations(num_blocks, block_size, ops):
    manager = KVCacheManager(num_blocks, block_size)
    lengths: dict[str, int] = {}
    for op, request_index, amount in ops:
        request_id = f"r{request_index}"
        if op == "allocate" and request_id not in lengths:
            if manager.allocate_slots(request_id, amount, keep_watermark=True):
                lengths[request_id] = amount
        elif op == "append" and request_id in lengths:
            before = manager.block_ids(request_id)[0]
            if manager.allocate_slots(request_id, lengths[request_id] + amount):
                lengths[request_id] += amount
                assert manager.block_ids(request_id)[0][: len(before)] == before  # tables only grow at the end
            else:
                assert manager.block_ids(request_id)[0] == before
        elif op == "free":  # finish or abort: the same for the manager
            manager.free(request_id)
            lengths.pop(request_id, None)
        manager.check_integrity()
        for rid, length in lengths.items():
            assert len(manager.block_ids(rid)[0]) == manager.blocks_for(length)
        all_ids = [b for rid in lengths for b in manager.block_ids(rid)[0]]
        assert len(all_ids) == len(set(all_ids))  # no block in two tables (no sharing without prefix caching)
    for rid in list(lengths):
        manager.free(rid)
    manager.check_integrity()
    assert manager.num_free_blocks == num_blocks
