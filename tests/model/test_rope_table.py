import torch

from kvserve.model.layers import RotaryEmbedding, rope_inv_freq
from kvserve.model.rope_table import CHUNK_POSITIONS, RopeTable


def _doubled(dim: int) -> torch.Tensor:
    inv_freq = rope_inv_freq(dim, 10000.0)
    return torch.cat((inv_freq, inv_freq))


def _per_step(doubled: torch.Tensor, positions: torch.Tensor, factor: float = 1.0):
    """What a step computed before the table: its positions times each frequency, then cos and sin."""
    emb = torch.outer(positions, doubled)
    return emb.cos() * factor, emb.sin() * factor


def test_entries_are_the_per_step_tables_bit_for_bit_and_the_table_grows_by_chunks():
    doubled = _doubled(64)
    table = RopeTable(doubled, 1.0, 8192)
    assert table.cos.shape == (CHUNK_POSITIONS, 64)
    positions = torch.tensor([0, 5, CHUNK_POSITIONS - 1, CHUNK_POSITIONS, 3 * CHUNK_POSITIONS + 7])
    for got, want in zip(table.lookup(positions), _per_step(doubled, positions)):
        assert torch.equal(got, want)
    assert table.cos.shape == (4 * CHUNK_POSITIONS, 64)  # grown to the chunk that holds the furthest position
    table.lookup(torch.tensor([4 * CHUNK_POSITIONS]))
    assert table.cos.shape == (8 * CHUNK_POSITIONS, 64)  # at least doubled: few copies over a long generation
    scaled = RopeTable(doubled, 1.25, 8192)  # YaRN / LongRoPE's attention factor
    for got, want in zip(scaled.lookup(positions), _per_step(doubled, positions, 1.25)):
        assert torch.equal(got, want)


def test_a_positions_entry_does_not_depend_on_its_batch_or_on_growth():
    # 24 rotated channels: a tensor's last elements may take another path through torch's cos; a table
    # entry is computed in its chunk only, whatever else a step asks for.
    table = RopeTable(_doubled(24), 1.0, 1 << 14)
    alone = table.lookup(torch.tensor([777]))
    batched = table.lookup(torch.tensor([3, 777, 1000, 1001, 5]))
    table.lookup(torch.tensor([9000]))  # grows: the held entries are copied, not recomputed
    grown = table.lookup(torch.tensor([777]))
    for a, b, c in zip(alone, batched, grown):
        assert torch.equal(a[0], b[1]) and torch.equal(a, c)


def test_positions_it_does_not_hold_are_computed_and_not_kept():
    doubled = _doubled(64)
    table = RopeTable(doubled, 1.0, 2048)
    for positions in (torch.tensor([-3, 4]), torch.tensor([5, 2**24 - 1]), torch.tensor([], dtype=torch.long)):
        for got, want in zip(table.lookup(positions), _per_step(doubled, positions)):
            assert torch.equal(got, want)
    assert table.cos.shape[0] == CHUNK_POSITIONS  # nothing past the limit, nothing for a negative position


def test_rotary_embedding_looks_up_its_table_and_rotation_stays_a_pure_rotation():
    rotary = RotaryEmbedding(64, 10000.0, context_length=4096)
    positions = torch.tensor([1, 4000])
    rotary(positions)  # the first table
    rotary.attention_factor = 1.5  # as YaRN sets it: a new table
    rotary.inv_freq = rotary.inv_freq / 2  # a new inv_freq: a new table
    doubled = torch.cat((rotary.inv_freq, rotary.inv_freq))
    for got, want in zip(rotary(positions), _per_step(doubled, positions, 1.5)):
        assert torch.equal(got, want)
    for got, want in zip(rotary.rotation(torch.tensor([-2])), _per_step(doubled, torch.tensor([-2]))):
        assert torch.equal(got, want)
    rotary.attention_factor = 1.0
    for got, want in zip(rotary(positions), _per_step(doubled, positions)):
        assert torch.equal(got, want)
