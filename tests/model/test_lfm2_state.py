"""A tiny LFM2 run in pieces over a paged KV cache and a state cache's slots (SlotStateContext), as the
engine will run it: chunks, batches of sequences, snapshots inside a forward and resumes from them must give
the logits and states of one whole forward."""

from dataclasses import replace

import torch

from kvserve.kv.attention import CpuAttentionBackend, SequenceSlice
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.context import StateSequence
from kvserve.kv.state.state_spec import state_spec
from kvserve.kv.state.storage import StateCache
from tests.helpers import TINY_VOCAB
from tests.model.test_lfm2 import load_model_in_process

SEQUENCE_LEN = 24
TOKENS = torch.randint(0, TINY_VOCAB, (2, SEQUENCE_LEN), generator=torch.Generator().manual_seed(11)).tolist()
TOLERANCE = 1e-5

# A forward's part for one sequence: (sequence, its first position, its row count, live slot, snapshots)
Piece = tuple[int, int, int, int, tuple[tuple[int, int], ...]]


class PagedHybrid:
    """A model over a paged KV cache (each sequence its own blocks) and a state cache of `num_slots` slots."""

    def __init__(self, model, num_slots: int = 8, block_size: int = 4) -> None:
        self.model = model
        self.backend = CpuAttentionBackend()
        spec = replace(kv_spec(model.config), layer_windows=tuple(model.layer_windows))
        groups, blocks = spec.layout.num_groups, -(-SEQUENCE_LEN // block_size)
        self.kv = self.backend.allocate_kv_cache(spec, len(TOKENS) * groups * blocks + 1, block_size)
        self.tables = [[[(s * groups + g) * blocks + b for b in range(blocks)] for g in range(groups)]
                       for s in range(len(TOKENS))]
        self.kv.initialize_blocks_through(len(TOKENS) * groups * blocks)
        self.states = StateCache(state_spec(model.config), num_slots)

    def forward(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """One forward over `pieces` (in batch order) -> each piece's logits."""
        slices, sequences, ids, positions, row = [], [], [], [], 0
        for seq, start, count, slot, snapshots in pieces:
            slices.append(SequenceSlice(self.tables[seq], start, count))
            sequences.append(StateSequence(row, count, start, slot, snapshots))
            ids += TOKENS[seq][start : start + count]
            positions += range(start, start + count)
            row += count
        logits = self.model(torch.tensor(ids), torch.tensor(positions), self.backend.build_context(self.kv, slices),
                            states=self.states.context(sequences))
        return list(logits.split([piece[2] for piece in pieces]))

    def slot(self, slot: int) -> list[torch.Tensor]:
        return [tensor[slot].clone() for layer in self.states.layers for tensor in layer]


def whole_logits(model, seq: int) -> torch.Tensor:
    return model(torch.tensor(TOKENS[seq]), torch.arange(SEQUENCE_LEN))


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{what}: max |diff| {diff:.2e}"


def test_batched_chunks_equal_whole_sequences():
    model = load_model_in_process("lfm2")
    run = PagedHybrid(model)
    # Two sequences in every forward, at different positions, split at different rows.
    steps = [[(0, 0, 10, 0, ()), (1, 0, 3, 1, ())], [(1, 3, 1, 1, ()), (0, 10, 1, 0, ())],
             [(0, 11, 13, 0, ()), (1, 4, 20, 1, ())]]
    outputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in steps:
        for piece, logits in zip(step, run.forward(step)):
            outputs[piece[0]].append(logits)
    for seq in (0, 1):
        assert_close(torch.cat(outputs[seq]), whole_logits(model, seq), f"sequence {seq}")
        # ... and over the paged cache, the same bits as one forward of the whole sequence (README "Determinism")
        alone = PagedHybrid(model).forward([(seq, 0, SEQUENCE_LEN, 0, ())])[0]
        assert torch.equal(torch.cat(outputs[seq]), alone)


def test_snapshots_hold_the_state_after_their_rows():
    model = load_model_in_process("lfm2")
    run = PagedHybrid(model)
    run.forward([(0, 0, SEQUENCE_LEN, 0, ((1, 1), (9, 2), (SEQUENCE_LEN, 3)))])
    assert all(torch.equal(a, b) for a, b in zip(run.slot(3), run.slot(0)))  # at the end: the live state
    for rows, slot in ((1, 1), (9, 2)):
        alone = PagedHybrid(model)
        alone.forward([(0, 0, rows, 4, ())])
        for got, expected in zip(run.slot(slot), alone.slot(4)):
            assert (got - expected).abs().max() <= 1e-6, f"snapshot after {rows} rows"
        assert any(not torch.equal(a, b) for a, b in zip(run.slot(slot), run.slot(0)))


def test_resuming_from_a_snapshot_continues_exactly():
    model = load_model_in_process("lfm2")
    whole = whole_logits(model, 0)
    paged_whole = PagedHybrid(model).forward([(0, 0, SEQUENCE_LEN, 0, ())])[0]
    run = PagedHybrid(model)
    run.forward([(0, 0, 14, 0, ((1, 1), (6, 2)))])
    # A later request shares the first 6 (or 1) tokens: it starts from a copy of the snapshot, and its
    # attention layers from the blocks already written.
    for rows, snapshot, live in ((6, 2, 5), (1, 1, 6)):
        run.states.copy_slots([(snapshot, live)])
        resumed = run.forward([(0, rows, 4, live, ())])[0]
        resumed = torch.cat([resumed] + run.forward([(0, rows + 4, 1, live, ())]))  # then a decode step
        assert_close(resumed, whole[rows : rows + 5], f"resumed after {rows} rows")
        assert torch.equal(resumed, paged_whole[rows : rows + 5])
