"""Attention sinks (gpt-oss) in the C++ paged attention kernel: each head's sink logit joins each row's softmax
denominator once, in the merge of the row's splits; against the torch reference (kv/attention/reference.py)."""

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.ops import KernelInputError
from kvserve.kv.attention.reference import attend

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 6, 2, 32, 16, 12


def _setup(dtype):
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(NUM_BLOCKS, generator=gen)
    sinks = torch.randn(HEADS, generator=gen) * 3
    return gen, k, v, table, sinks


def _rows(table, positions, window):
    pos = torch.tensor(positions, dtype=torch.long)
    low = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    return ops.RowTables(table.long(), torch.zeros_like(pos), low, pos)


@pytest.mark.parametrize("dtype", ops.CACHE_DTYPES)
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("split_blocks", [16, 2])  # one split per row, or several merged
def test_sinks_match_the_reference(dtype, window, split_blocks):
    gen, k, v, table, sinks = _setup(dtype)
    positions = [0, 5, 17, 63, 100, 191]
    q = torch.randn(len(positions), HEADS, HEAD_DIM, generator=gen)
    out = ops.paged_decode(q, k, v, _rows(table, positions, window), HEAD_DIM**-0.5, split_blocks, sinks)
    keys = k[table].float().permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)  # [KVH, positions, D]
    values = v[table].float().permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)
    for row, p in enumerate(positions):
        expected = attend(q[row : row + 1].transpose(0, 1), keys[:, : p + 1], values[:, : p + 1], torch.tensor([p]),
                          HEAD_DIM**-0.5, window, sinks=sinks)
        torch.testing.assert_close(out[row : row + 1], expected, atol=2e-5, rtol=1e-4)
    plain = ops.paged_decode(q, k, v, _rows(table, positions, window), HEAD_DIM**-0.5, split_blocks)
    assert (plain - out).abs().max() > 1e-2  # the sinks took weight off the keys
    drowned = ops.paged_decode(q, k, v, _rows(table, positions, window), HEAD_DIM**-0.5, split_blocks,
                               torch.full((HEADS,), -1e4))
    torch.testing.assert_close(drowned, plain, atol=1e-6, rtol=0)  # a sink far below every score: no change


def test_a_row_with_sinks_does_not_depend_on_its_batch():
    gen, k, v, table, sinks = _setup(torch.float32)
    positions = list(range(150, 192))
    q = torch.randn(len(positions), HEADS, HEAD_DIM, generator=gen)
    batch = ops.paged_decode(q, k, v, _rows(table, positions, None), HEAD_DIM**-0.5, 2, sinks)
    for row in (0, 17, 41):
        alone = ops.paged_decode(q[row : row + 1], k, v, _rows(table, positions[row : row + 1], None),
                                 HEAD_DIM**-0.5, 2, sinks)
        assert torch.equal(alone[0], batch[row])


def test_sinks_of_the_wrong_shape_are_refused():
    gen, k, v, table, _ = _setup(torch.float32)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    with pytest.raises(KernelInputError, match="one CPU logit per query head"):
        ops.paged_decode(q, k, v, _rows(table, [3], None), 0.2, 2, torch.zeros(HEADS - 1))
