"""The recurrent-state bookkeeping (kv/state/slots.py, kv/state/manager.py) without a model: which slots a
step reads and writes, which snapshots it keeps, and that every hold is given back."""

import pytest

from kvserve.errors import KVIntegrityError
from kvserve.kv.state.manager import RecurrentStates
from kvserve.kv.state.slots import StateSlots

BLOCK = 4


def hashes(n: int, prefix: str = "h") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def run_step(states: RecurrentStates, request: str, start: int, count: int, chain: list[str], speculative: int = 0,
             kept: int | None = None):
    step = states.plan_step(request, start, count, speculative)
    end = start + count if kept is None else kept
    if kept is not None:
        assert states.resumable_tokens(request, kept) == kept
        states.cut(request, kept)
    states.after_step(request, end, chain[: end // BLOCK])
    states.check_integrity()
    return step


def test_slots_evict_the_least_recently_used_snapshot_nobody_holds():
    slots = StateSlots(3)
    a, b = slots.allocate(), slots.allocate()
    assert slots.register(a, "x") and slots.register(b, "y")
    assert not slots.register(slots.allocate(), "x")  # one snapshot per chain
    slots.release(2)
    slots.release(a)
    slots.release(b)  # a is the older snapshot
    slots.hold(a)  # ... until a hit reads it
    slots.release(a)
    assert slots.allocate() == 2 and slots.allocate() == b  # the empty slot first, then the LRU snapshot
    assert slots.lookup("y") is None and slots.lookup("x") == a and slots.num_evicted == 1
    assert slots.allocate() == a and slots.allocate() is None
    with pytest.raises(KVIntegrityError):
        StateSlots(1).release(0)


def test_a_prompt_leaves_grid_and_tail_snapshots_and_a_hit_reads_one():
    states = RecurrentStates(16, BLOCK, snapshot_interval=2, enable_caching=True)
    chain = hashes(10)
    assert states.start("a", 0, None)
    step = run_step(states, "a", 0, 22, chain)  # one chunk: grid at 8 and 16, tail at 20
    assert [rows for rows, _ in step.snapshots] == [8, 16, 20]
    assert states.longest_hit(chain, 5) == 5 and states.longest_hit(chain, 4) == 4 and states.longest_hit(chain, 3) == 2
    step = run_step(states, "a", 22, 1, chain)  # a decode step crossing no boundary snapshots nothing
    assert step.snapshots == () and step.source != step.slot  # read one slot, write another
    states.free("a")
    states.check_integrity()
    snapshot = states.snapshot_for(chain, 4)
    assert states.start("b", 16, snapshot)
    step = run_step(states, "b", 16, 6, chain)
    assert step.source == snapshot and step.slot != snapshot
    states.free("b")
    assert states.slots.num_held == 0


def test_a_newer_tail_drops_the_older_one_but_never_a_grid_point():
    states = RecurrentStates(16, BLOCK, snapshot_interval=4, enable_caching=True)
    chain = hashes(10)
    states.start("a", 0, None)
    run_step(states, "a", 0, 5, chain)  # tail at 4
    run_step(states, "a", 5, 4, chain)  # tail at 8: the one at 4 is dropped
    run_step(states, "a", 9, 8, chain)  # grid at 16 (kept), tail at 16 too
    assert [states.longest_hit(chain, n) for n in (1, 2, 3, 4)] == [0, 2, 2, 4]
    states.free("a")
    assert states.slots.num_snapshots == 2 and states.slots.num_held == 0


def test_rejected_drafts_swap_a_checkpoint_in():
    states = RecurrentStates(16, BLOCK, snapshot_interval=8, enable_caching=True)
    chain = hashes(10)
    states.start("a", 0, None)
    run_step(states, "a", 0, 6, chain)
    step = states.plan_step("a", 6, 5, 4)  # the last token and 4 drafts: checkpoints after 7, 8, 9, 10
    assert {6 + rows for rows, _ in step.snapshots} >= {7, 8, 9, 10}
    assert states.resumable_tokens("a", 9) == 9 and states.resumable_tokens("a", 6) == 0
    states.cut("a", 9)  # two drafts rejected
    assert states.live_slot("a") == dict((6 + rows, slot) for rows, slot in step.snapshots)[9]
    states.after_step("a", 9, chain[:2])
    states.check_integrity()
    states.check_request("a", 9)
    states.free("a")
    assert states.slots.num_held == 0


def test_a_fork_between_grid_points_is_snapshotted_for_the_next_request():
    states = RecurrentStates(16, BLOCK, snapshot_interval=4, enable_caching=True)
    chain = hashes(10)
    states.start("a", 0, None, fork_at=12)  # its attention blocks hit 12 tokens; no snapshot there yet
    step = run_step(states, "a", 0, 14, chain)
    assert 12 in [rows for rows, _ in step.snapshots]
    states.free("a")
    assert states.longest_hit(chain, 3) == 3


def test_without_free_slots_a_request_waits_and_snapshots_are_skipped():
    states = RecurrentStates(2, BLOCK, snapshot_interval=1, enable_caching=True)
    chain = hashes(10)
    assert states.start("a", 0, None) and states.start("b", 0, None)
    assert not states.start("c", 0, None)
    step = run_step(states, "a", 0, 9, chain)
    assert step.snapshots == ()  # best-effort: nothing was free
    states.free("a")
    states.free("b")
    assert states.slots.num_held == 0 and states.slots.num_snapshots == 0


def test_the_state_must_follow_the_computed_tokens():
    states = RecurrentStates(4, BLOCK, snapshot_interval=1, enable_caching=True)
    states.start("a", 0, None)
    with pytest.raises(KVIntegrityError, match="covers 0 tokens"):
        states.plan_step("a", 3, 1, 0)
    run_step(states, "a", 0, 3, hashes(1))
    with pytest.raises(KVIntegrityError, match="covers 3"):
        states.check_request("a", 2)
