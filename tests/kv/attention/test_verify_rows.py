"""A verify (or a run of forced tokens) on the cpu backend: k + 1 queries of one request, attended in ONE kernel
call per layer for the whole batch, with the bits of k + 1 single-token decodes, per cache dtype and window;
against per-sequence reference attention over the K/V as the cache holds them."""

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kv.attention import CpuAttentionBackend, SequenceSlice, attend, build_attention_metadata
from kvserve.kv.cache.kv_spec import KVSpec
from tests.kv.attention.test_cpu import poison, seen

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ paged-decode kernel could not be built here")
DTYPES = ["float32", "float16", "bfloat16", "int8", "int4", "int8/int4", "int4/int8"]


class Calls:
    """The decode kernels, counted."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in ("paged_decode", "paged_decode_quant"):
            monkeypatch.setattr(ops, name, self.counted(getattr(ops, name)))

    def counted(self, kernel):
        def call(*args, **kwargs):
            self.count += 1
            return kernel(*args, **kwargs)
        return call


def steps(cache_dtype, heads, kv_heads, head_dim, block, window, cached, drafts, verify, calls=None):
    """Request A caches `cached` tokens (a prefill) while B decodes, then computes drafts + 1 tokens: in one
    step as the runner lays a verify out (single-token slices of one table, B's decode beside them) or, with
    `verify` off, one token a step. A's outputs `[drafts + 1, H * D]`, its K/V, queries and the cache."""
    gen = torch.Generator().manual_seed(cached * 31 + drafts)
    total = cached + drafts + 1
    blocks_a, blocks_b = -(-total // block), -(-(2 * block + 2) // block)
    cache = CpuAttentionBackend().allocate_kv_cache(KVSpec(1, kv_heads, head_dim, cache_dtype, (window,)),
                                                   blocks_a + blocks_b + 4, block, max_num_seqs=4)
    poison(cache)
    cache.initialize_blocks_through(blocks_a + blocks_b + 3)
    order = torch.randperm(blocks_a + blocks_b + 4, generator=gen).tolist()
    table_a, table_b = order[:blocks_a], order[blocks_a : blocks_a + blocks_b]
    k, v = torch.randn(total, kv_heads, head_dim, generator=gen), torch.randn(total, kv_heads, head_dim, generator=gen)
    q = torch.randn(total, heads, head_dim, generator=gen)
    kb, vb, qb = (torch.randn(2 * block + 2, h, head_dim, generator=gen) for h in (kv_heads, kv_heads, heads))
    backend, scale = CpuAttentionBackend(), head_dim**-0.5

    def step(slices, rows):
        context = backend.build_context(cache, slices)
        rows_k = torch.cat([x[i : i + 1] for x, i in rows[0]]), torch.cat([x[i : i + 1] for x, i in rows[1]])
        return context.attend(0, torch.cat([x[i : i + 1] for x, i in rows[2]]), *rows_k, scale)

    def tokens(a, b):  # rows of A's positions a, then B's b: (K, V, Q) sources per row
        return [[(x, i) for i in a] + [(y, j) for j in b] for x, y in ((k, kb), (v, vb), (q, qb))]

    if cached:
        step([SequenceSlice((table_a,), 0, cached)], tokens(range(cached), []))
    step([SequenceSlice((table_b,), 0, 2 * block)], tokens([], range(2 * block)))
    new = range(cached, total)
    if verify:
        before = calls.count if calls else 0
        slices = [SequenceSlice((table_a,), p, 1) for p in new] + [SequenceSlice((table_b,), 2 * block, 1)]
        out = step(slices, tokens(new, [2 * block]))[: len(new)]
        if calls:
            assert calls.count - before == 1  # A's k + 1 queries and B's decode: one kernel call
    else:
        out = torch.cat([step([SequenceSlice((table_a,), p, 1)], tokens([p], [])) for p in new])
    return out, k, v, q, cache


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [(6, 2, 16, 4), (9, 3, 64, 16)])
@pytest.mark.parametrize("window", [None, 6])
# Drafts that stay in a block, fill one from inside it, start at a block's first row, span whole blocks.
@pytest.mark.parametrize("cached_blocks,offset,drafts", [(1, 1, 1), (1, 1, 5), (2, 0, 3), (0, 2, 9), (1, 3, 0)])
def test_a_verify_is_one_kernel_call_with_the_bits_of_single_token_decodes(
        monkeypatch, cache_dtype, heads, kv_heads, head_dim, block, window, cached_blocks, offset, drafts):
    shape = (heads, kv_heads, head_dim, block, window, cached_blocks * block + offset, drafts)
    one_call, k, v, q, cache = steps(cache_dtype, *shape, verify=True, calls=Calls(monkeypatch))
    one_by_one = steps(cache_dtype, *shape, verify=False)[0]
    assert torch.equal(one_call, one_by_one)
    cached = cached_blocks * block + offset
    for row, position in enumerate(range(cached, cached + drafts + 1)):
        keys, values = seen(cache, k[: position + 1], v[: position + 1], position)  # as the cache holds them
        expected = attend(q[position : position + 1].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                          torch.tensor([position]), head_dim**-0.5, window)
        torch.testing.assert_close(one_call[row : row + 1], expected, rtol=1e-5, atol=1e-5)


def test_a_verifys_single_token_slices_are_one_run_of_rows_over_one_table():
    """The runner lays a verify out as single-token slices of one table: its rows share one copy of the table
    (so the kernel attends them in tiles), where another request's decode beside them keeps its own."""
    table, other = [5, 2, 7], [1, 3]
    slices = [SequenceSlice((table,), p, 1) for p in range(9, 12)] + [SequenceSlice((other,), 6, 1)]
    for as_rows in (True, False):
        meta = build_attention_metadata(slices, 4, tokens_as_rows=as_rows, block_lists=False).decode
        assert meta.row_table.tolist() == [0, 0, 0, 3]
        assert meta.tables.tolist() == table + other
        assert meta.row_pos.tolist() == [9, 10, 11, 6]
    # A copy of the table is another request's: its slice starts a run of its own.
    meta = build_attention_metadata(slices[:2] + [SequenceSlice((list(table),), 11, 1)], 4).decode
    assert meta.row_table.tolist() == [0, 0, 3]
