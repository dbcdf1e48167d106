"""Kernel-level batch invariance (issue 36, DESIGN §3 Determinism): a row's bits do not depend on the rows
beside it. The quantized matmul's row m alone (M = 1) against the same row inside M = 2..64; the paged
attention kernel's query row alone against the same row inside a batch of other requests' rows and inside
its own prefill chunk (where every token is a row)."""

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.kquant_packing import KQUANT_KINDS, pack_kquant
from kvserve.kernels.packing import pack, quantize_groups
from tests.kernels.test_kquant_matmul import random_kquant
from tests.kernels.test_quant_matmul import ZERO_POINTS, zero_point_codes

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
RUNNABLE = list(ISAS)[: ISAS[ops.quant_matmul_isa()] + 1] if ops.available() else []


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("bits", [4, 8])
# 40: two full tiles of 16 outputs and a partial one; 120: eight tiles, so that a lone row (which takes its
# tiles four at a time) has the partial last tile inside a run of four, on one thread or two.
@pytest.mark.parametrize("outputs", [40, 120])
@pytest.mark.parametrize("folded", [False, True], ids=["offsets", "zero_point"])
def test_quant_matmul_rows_alone_equal_the_same_rows_in_any_batch(isa, bits, outputs, folded):
    gen = torch.Generator().manual_seed(bits)
    cols = 192
    codes = (zero_point_codes(outputs, cols, bits, gen) if folded
             else quantize_groups(torch.randn(outputs, cols, generator=gen), bits))
    zero = ZERO_POINTS[bits] if folded else None
    packed = pack(codes, offsets=not folded)
    x = torch.randn(64, cols, generator=gen)
    alone = torch.cat([ops.quant_matmul(x[m : m + 1], packed, bits, outputs, ISAS[isa], zero=zero)
                       for m in range(64)])
    for rows in range(2, 65):
        start = (7 * rows) % (65 - rows)  # the batch's rows sit anywhere in the batch
        batch = ops.quant_matmul(x[start : start + rows], packed, bits, outputs, ISAS[isa], zero=zero)
        assert torch.equal(batch, alone[start : start + rows]), f"M={rows}"


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("bits,table", [(4, None), (8, None), (4, torch.arange(0, 32, 2, dtype=torch.uint8))])
@pytest.mark.parametrize("outputs", [16, 120, 1000])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("zero", [None, 8])
def test_tiles_read_side_by_side_give_the_same_bits(isa, bits, table, outputs, rows, zero):
    """A decode batch's tiles taken 1, 2 or 4 at a time (spread over each thread's range): the same bits, with
    tiles left over and a partial last tile (120: 7.5 tiles; 1000: 62.5), offsets read or a zero point folded."""
    gen = torch.Generator().manual_seed(outputs + bits)
    cols = 160
    packed = pack(quantize_groups(torch.randn(outputs, cols, generator=gen), bits), offsets=zero is None)
    x = torch.randn(rows, cols, generator=gen)
    one_at_a_time = ops.quant_matmul(x, packed, bits, outputs, ISAS[isa], table=table, runs=1, zero=zero)
    for runs in (0, 2, 4):
        assert torch.equal(ops.quant_matmul(x, packed, bits, outputs, ISAS[isa], table=table, runs=runs, zero=zero),
                           one_at_a_time), f"runs={runs}"
    # Each row alone (a lone row takes the most runs) gives its bits in the batch.
    for m in range(rows):
        assert torch.equal(ops.quant_matmul(x[m : m + 1], packed, bits, outputs, ISAS[isa], table=table, zero=zero),
                           one_at_a_time[m : m + 1]), f"row {m}"


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("runs", [0, 1, 2, 4])
def test_no_rows_give_an_empty_product(isa, runs):
    """A step whose rows need no logits multiplies zero rows: an empty result, nothing read or written."""
    packed = pack(quantize_groups(torch.randn(200, 64), 8))
    y = ops.quant_matmul(torch.empty(0, 64), packed, 8, 200, ISAS[isa], runs=runs)
    assert y.shape == (0, 200)


def test_runs_other_than_one_two_or_four_are_refused():
    packed = pack(quantize_groups(torch.randn(16, 32), 4))
    with pytest.raises(RuntimeError, match="runs must be 0, 1, 2 or 4"):
        ops.quant_matmul(torch.randn(1, 32), packed, 4, 16, runs=3)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kind", list(KQUANT_KINDS))
def test_kquant_matmul_rows_alone_equal_the_same_rows_in_any_batch(isa, kind):
    outputs, cols = 40, 512  # two full tiles of 16 outputs and a partial one, two super-blocks
    packed = pack_kquant(random_kquant(kind, outputs, cols, KQUANT_KINDS[kind]))
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(5))
    number = KQUANT_KINDS[kind]
    alone = torch.cat([ops.kquant_matmul(x[m : m + 1], packed, number, outputs, isa=ISAS[isa]) for m in range(64)])
    for rows in range(2, 65):
        start = (7 * rows) % (65 - rows)
        batch = ops.kquant_matmul(x[start : start + rows], packed, number, outputs, isa=ISAS[isa])
        assert torch.equal(batch, alone[start : start + rows]), f"M={rows}"


def _rows(tables: list[list[int]], runs: list[tuple[int, int, int]], window: int | None, block: int) -> ops.RowTables:
    """Kernel rows for runs (table index, first position, count)."""
    flat, starts = [], []
    for table in tables:
        starts.append(len(flat))
        flat.extend(table)
    row_table, low, pos = [], [], []
    for index, first, count in runs:
        for p in range(first, first + count):
            row_table.append(starts[index])
            low.append(max(0, p - window + 1) if window else 0)
            pos.append(p)
    return ops.RowTables(*(torch.tensor(x, dtype=torch.long) for x in (flat, row_table, low, pos)))


@pytest.mark.parametrize("dtype", ops.CACHE_DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(64, 9, 3, None), (64, 9, 3, 40), (32, 4, 4, None),
                                                             (256, 4, 1, None), (48, 6, 2, None)])
def test_paged_attention_row_alone_equals_it_in_a_batch_or_a_prefill_chunk(dtype, head_dim, heads, kv_heads, window):
    gen = torch.Generator().manual_seed(head_dim + heads)
    block, num_blocks = 16, 48
    k = torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[:24], perm[24:]]  # two requests of up to 384 tokens each
    length = 330  # request 0's tokens: its chunk is every one of them, one row each
    q = torch.randn(length + 64, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    for split_blocks in (16, 3, 0):  # 0: one split per row, as long as the row
        chunk = ops.paged_decode(q[:length], k, v, _rows(tables, [(0, 0, length)], window, block), scale, split_blocks)
        # Beside 64 rows of request 1 (other positions), after and before them.
        mixed = ops.paged_decode(torch.cat([q[length:], q[:length]]), k, v,
                                 _rows(tables, [(1, 300, 64), (0, 0, length)], window, block), scale, split_blocks)
        for p in list(range(0, length, 37)) + [length - 1]:
            alone = ops.paged_decode(q[p : p + 1], k, v, _rows(tables, [(0, p, 1)], window, block), scale, split_blocks)
            assert torch.equal(chunk[p], alone[0]), f"position {p} in its chunk"
            assert torch.equal(mixed[64 + p], alone[0]), f"position {p} in a batch"
        for batch in (2, 5, 64):
            rows = ops.paged_decode(q[-batch:], k, v, _rows(tables, [(1, 383 - batch + 1, batch)], window, block),
                                    scale, split_blocks)
            last = ops.paged_decode(q[-1:], k, v, _rows(tables, [(1, 383, 1)], window, block), scale, split_blocks)
            assert torch.equal(rows[-1], last[0]), f"the last of {batch} rows"
