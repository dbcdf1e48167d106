"""The recurrent-state seam's semantics (kv/state/context.py, kv/state/storage.py) on a toy recurrence, a
running sum: where a sequence's state is read from, where it and its snapshots are written, how a forward's
rows are split among sequences and at snapshots, and how slots are copied."""

import pytest
import torch

from kvserve.kv.state.context import ContiguousStateContext, StateSequence, scan_sequences
from kvserve.kv.state.state_spec import StateSpec
from kvserve.kv.state.storage import StateCache

WIDTH = 3
ROWS = torch.arange(1.0, 1 + 10 * WIDTH).reshape(10, WIDTH)  # ten rows, each a different vector


class RunningSum:
    """A Recurrence: each output is the state plus the rows so far; the state, the sum after the last row.
    Records the row count of every call (how scan_sequences split the rows)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, rows: torch.Tensor, state):
        self.calls.append(rows.shape[0])
        before = torch.zeros(rows.shape[1]) if state is None else state[0]
        outputs = before + rows.cumsum(dim=0)
        return outputs, [outputs[-1]]


def cache(num_slots: int = 6, layers: int = 2) -> StateCache:
    return StateCache(StateSpec(layers, ((WIDTH,),)), num_slots)


def slot(states: StateCache, index: int, layer: int = 0) -> torch.Tensor:
    return states.layers[layer][0][index]


def test_a_contiguous_context_starts_fresh_and_keeps_nothing():
    recurrence = RunningSum()
    out = scan_sequences(ContiguousStateContext(10), 0, ROWS, recurrence)
    assert torch.equal(out, ROWS.cumsum(dim=0)) and recurrence.calls == [10]


def test_sequences_read_their_slot_unless_fresh_and_write_it_after_their_last_row():
    states = cache()
    states.layers[0][0][0] = 1000.0  # a fresh sequence (start 0) must not read its slot's old contents
    states.layers[0][0][1] = 100.0
    sequences = [StateSequence(0, 4, 0, 0), StateSequence(4, 6, 7, 1)]
    recurrence = RunningSum()
    out = scan_sequences(states.context(sequences), 0, ROWS, recurrence)
    expected = torch.cat([ROWS[:4].cumsum(dim=0), 100.0 + ROWS[4:].cumsum(dim=0)])
    assert torch.equal(out, expected) and recurrence.calls == [4, 6]
    assert torch.equal(slot(states, 0), ROWS[:4].sum(dim=0))
    assert torch.equal(slot(states, 1), 100.0 + ROWS[4:].sum(dim=0))
    assert torch.equal(slot(states, 0, layer=1), torch.zeros(WIDTH))  # another layer's slots untouched


def test_snapshots_split_the_rows_and_copy_the_state_out():
    # Snapshots after row 1 and after 3 rows, and one at the end (the live state's value): three pieces,
    # never an empty one, outputs in row order.
    states = cache()
    sequence = StateSequence(0, 10, 0, 0, snapshots=((1, 2), (3, 3), (10, 4)))
    recurrence = RunningSum()
    out = scan_sequences(states.context([sequence]), 0, ROWS, recurrence)
    assert torch.equal(out, ROWS.cumsum(dim=0)) and recurrence.calls == [1, 2, 7]
    assert torch.equal(slot(states, 2), ROWS[0])
    assert torch.equal(slot(states, 3), ROWS[:3].sum(dim=0))
    assert torch.equal(slot(states, 4), slot(states, 0)) and torch.equal(slot(states, 0), ROWS.sum(dim=0))


def test_a_decode_rows_snapshot_is_its_state_after_that_row():
    states = cache()
    states.layers[0][0][0] = 5.0
    sequence = StateSequence(0, 1, 12, 0, snapshots=((1, 1),))
    recurrence = RunningSum()
    scan_sequences(states.context([sequence]), 0, ROWS[:1], recurrence)
    assert recurrence.calls == [1]
    assert torch.equal(slot(states, 1), 5.0 + ROWS[0]) and torch.equal(slot(states, 0), slot(states, 1))


def test_a_source_slot_is_read_and_left_as_it_was():
    # Reading one slot and writing another: the step can be run again from the same state (a retried batch),
    # and a prefix hit reads its snapshot without changing it.
    states = cache()
    states.layers[0][0][3] = 7.0
    sequence = StateSequence(0, 2, 4, 1, source=3)
    for _ in range(2):
        out = scan_sequences(states.context([sequence]), 0, ROWS[:2], RunningSum())
        assert torch.equal(out, 7.0 + ROWS[:2].cumsum(dim=0))
    assert torch.equal(slot(states, 3), torch.full((WIDTH,), 7.0))
    assert torch.equal(slot(states, 1), 7.0 + ROWS[:2].sum(dim=0))


def test_resuming_from_a_snapshot_continues_the_whole_sequence():
    states = cache()
    first = StateSequence(0, 6, 0, 0, snapshots=((4, 2),))
    scan_sequences(states.context([first]), 0, ROWS[:6], RunningSum())
    states.copy_slots([(2, 5)])  # a second request sharing the first four rows
    resumed = scan_sequences(states.context([StateSequence(0, 6, 4, 5)]), 0, ROWS[4:], RunningSum())
    assert torch.equal(resumed, ROWS.cumsum(dim=0)[4:])


def test_copy_slots_reads_every_source_before_writing():
    states = cache(layers=2)
    for layer in range(2):
        for index in range(6):
            states.layers[layer][0][index] = 10.0 * layer + index
    states.copy_slots([(0, 1), (1, 0), (1, 2), (4, 4)])  # a swap, a chain from a slot also written, a no-op
    for layer in range(2):
        values = states.layers[layer][0][:, 0].tolist()
        assert values == [10.0 * layer + i for i in (1, 0, 1, 3, 4, 5)]
    states.copy_slots([])  # nothing to do


def test_cache_size_and_bad_slot_counts():
    spec = StateSpec(3, ((WIDTH, 2), (WIDTH,)))
    assert StateCache(spec, 4).nbytes == 4 * spec.slot_bytes == 4 * 3 * (WIDTH * 2 + WIDTH) * 4
    with pytest.raises(ValueError, match="at least one slot"):
        StateCache(spec, 0)
