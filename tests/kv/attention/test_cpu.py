"""The cpu backend: paged attention for a mixed batch (several decodes + prefill chunks) against per-sequence SDPA."""

import pytest
import torch

from kvserve.kv.attention import (CpuAttentionBackend, PagedKVContext, SequenceSlice, attend, attention_mask,
                                  build_attention_metadata)
from kvserve.kv.attention.cpu import slot_indices
from kvserve.kv.cache.kv_spec import KVSpec
from kvserve.kv.cache.storage import PagedKVCache
from tests.helpers import write_tokens

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4
CACHE_DTYPES = ["float32", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2", "int8/int4"]
CPU = CpuAttentionBackend()


def poison(cache: PagedKVCache) -> None:
    """NaN (or garbage) everywhere: what attention reads must have been written."""
    for t in cache.k + cache.v + cache.k_params + cache.v_params:
        t.fill_(float("nan") if t.is_floating_point() else 0x7F)  # 0x7F: NaN as fp8 bytes


def stored(side, x: torch.Tensor) -> torch.Tensor:
    """What one side of the cache (cache.keys / cache.values) gives back for `x`: attention over
    these values is the reference."""
    return side.codec.decode(*side.codec.encode(x), torch.float32)


def seen(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[tokens, KVH, D]` of one sequence, all written, as a query at `position` reads them. With open
    blocks (int4 keys per channel over a block): every block encoded whole from its float16 rows, except the
    query's own block, read in float16 unless the query is its last row."""
    if cache.open_blocks is None:
        return stored(cache.keys, k), stored(cache.values, v)
    out, block = [], cache.block_size
    for side, x in ((cache.keys, k), (cache.values, v)):
        x = x.half().float()
        padded = torch.cat([x, x.new_zeros(-len(x) % block, *x.shape[1:])])
        blocks = padded.view(-1, block, *x.shape[1:]).transpose(1, 2)  # [blocks, KVH, rows, D]
        decoded = side.codec.decode_blocks(*side.codec.encode_blocks(blocks), torch.float32)
        decoded = decoded.transpose(1, 2).reshape(-1, *x.shape[1:])[: len(x)]
        if position % block != block - 1:
            own = position - position % block
            decoded[own:] = x[own:]
        out.append(decoded)
    return out[0], out[1]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_mixed_batch_matches_per_sequence_attention(window, cache_dtype):
    check_mixed_batch(window, cache_dtype)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "int4"])  # int4: open blocks
@pytest.mark.parametrize("decodes", ["split", "union"])
def test_attention_sinks_join_every_torch_paths_denominator(window, cache_dtype, decodes):
    # gpt-oss: split-KV and union decodes, prefill chunks (flash, masked, open-block), each against the reference.
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(1)) * 2
    check_mixed_batch(window, cache_dtype, sinks, union_factor=None if decodes == "split" else 1e9)


def check_mixed_batch(window, cache_dtype, sinks=None, union_factor=4):
    gen = torch.Generator().manual_seed(0)
    # (tokens already cached, tokens computed this step): three decodes, then two prefill chunks.
    shapes = [(0, 1), (9, 1), (16, 1), (0, 7), (6, 5)]
    cache = CPU.allocate_kv_cache(KVSpec(1, KV_HEADS, HEAD_DIM, cache_dtype), num_blocks=40, block_size=BLOCK)
    poison(cache)
    free = torch.randperm(40, generator=gen).tolist()
    full_k, full_v, slices = [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        cache.initialize_blocks_through(max(table))
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        if cached:  # what earlier steps wrote
            write_tokens(cache, 0, table, 0, k[:cached], v[:cached])
        full_k.append(k)
        full_v.append(v)
        slices.append(SequenceSlice((table,), cached, new))
    meta = build_attention_metadata(slices, BLOCK, window, union_factor=union_factor)
    assert meta.num_decode_tokens == 3 and len(meta.prefills) == 2
    assert (meta.decode.union_block_ids is None) == (union_factor is None)  # None: split-KV
    q = torch.randn(sum(n for _, n in shapes), HEADS, HEAD_DIM, generator=gen)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    out = PagedKVContext(cache, [meta]).attend(0, q, new_k, new_v, HEAD_DIM**-0.5, sinks)

    row = 0
    for (cached, new), k, v in zip(shapes, full_k, full_v):
        for position in range(cached, cached + new):  # each query over the K/V it reads
            sk, sv = seen(cache, k, v, position)
            expected = attend(q[row : row + 1].transpose(0, 1), sk.transpose(0, 1), sv.transpose(0, 1),
                              torch.tensor([position]), HEAD_DIM**-0.5, window, sinks=sinks)
            torch.testing.assert_close(out[row : row + 1], expected, atol=1e-5, rtol=1e-5)
            row += 1


def test_mask_is_bottom_right_aligned():
    mask = attention_mask(torch.tensor([3, 4]), 5, None)
    assert mask.tolist() == [[True, True, True, True, False], [True] * 5]
    assert attention_mask(torch.tensor([4]), 5, None) is None  # plain decode: no mask
    assert attention_mask(torch.tensor([4]), 5, 2).tolist() == [[False, False, False, True, True]]


@pytest.mark.parametrize("window", [None, 5])
def test_slots_made_with_the_metadata_are_slot_indices(window):
    """The builder's integer slots (what the backend writes new K/V at) equal slot_indices' of its blocks
    and rows, for decodes and prefill chunks, as rows of the kernel or not; without a head count, none."""
    slices = [SequenceSlice(([7, 2, 9],), 9, 1), SequenceSlice(([4],), 0, 1), SequenceSlice(([3, 11, 5],), 2, 7)]
    for as_rows in (False, True):
        meta = build_attention_metadata(slices, BLOCK, window, tokens_as_rows=as_rows, num_kv_heads=KV_HEADS)
        assert meta.slots.tolist() == slot_indices(meta.slot_blocks, meta.slot_rows, KV_HEADS, BLOCK).tolist()
        assert len(meta.slots) == 9 * KV_HEADS
        assert build_attention_metadata(slices, BLOCK, window, tokens_as_rows=as_rows).slots is None


def test_block_table_too_short_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([SequenceSlice(([0],), 3, 2)], BLOCK)


def test_initialize_blocks_zeroes_each_block_once():
    cache = CPU.allocate_kv_cache(KVSpec(2, KV_HEADS, HEAD_DIM, "float32"), num_blocks=200, block_size=BLOCK)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    cache.initialize_blocks_through(3)  # blocks 1 and 3 are about to be used
    assert all(t[:4].eq(0).all() and t[150:].isnan().all() for t in cache.k + cache.v)
    cache.k[0][1].fill_(5.0)
    cache.initialize_blocks_through(120)  # block 1 keeps its data; 120 is zeroed
    assert cache.k[0][1].eq(5.0).all() and cache.k[1][120].eq(0).all() and cache.v[0][199].isnan().all()


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("cache_dtype", ["float32", "int8", "int4", "fp8_e4m3", "int8/int4"])
def test_decodes_sharing_a_prefix_use_the_union_and_match(window, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    cache = CPU.allocate_kv_cache(KVSpec(1, KV_HEADS, HEAD_DIM, cache_dtype), num_blocks=40, block_size=BLOCK)
    shared = [5, 9, 2, 30]  # a 16-token prefix in four blocks
    prefix_k = torch.randn(16, KV_HEADS, HEAD_DIM, generator=gen)
    prefix_v = torch.randn(16, KV_HEADS, HEAD_DIM, generator=gen)
    cache.initialize_blocks_through(max(shared + [11, 12, 13, 14, 15, 16]))
    cache.k[0].fill_(100)  # stale, finite garbage in rows not written below
    cache.v[0].fill_(-100)
    write_tokens(cache, 0, shared, 0, prefix_k, prefix_v)
    # six requests: the shared prefix + 1..6 tokens of their own in one private block each
    slices, full_k, full_v = [], [], []
    for i, own in enumerate([1, 2, 3, 4, 2, 1]):
        k = torch.cat([prefix_k, torch.randn(own, KV_HEADS, HEAD_DIM, generator=gen)])
        v = torch.cat([prefix_v, torch.randn(own, KV_HEADS, HEAD_DIM, generator=gen)])
        table = shared + [11 + i]
        if own > 1:
            write_tokens(cache, 0, table, 16, k[16:-1], v[16:-1])
        slices.append(SequenceSlice((table,), 16 + own - 1, 1))
        full_k.append(k)
        full_v.append(v)
    meta = build_attention_metadata(slices, BLOCK, window)
    assert meta.decode.union_block_ids is not None  # heavy sharing: the union path
    q = torch.randn(6, HEADS, HEAD_DIM, generator=gen)
    new_k = torch.stack([k[-1] for k in full_k])
    new_v = torch.stack([v[-1] for v in full_v])
    out = PagedKVContext(cache, [meta]).attend(0, q, new_k, new_v, HEAD_DIM**-0.5)
    for i, (k, v) in enumerate(zip(full_k, full_v)):
        k, v = seen(cache, k, v, len(k) - 1)
        expected = attend(q[i : i + 1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                          torch.tensor([k.shape[0] - 1]), HEAD_DIM**-0.5, window)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def test_what_counts_as_a_decode_is_the_backends_rule():
    # batch_order and the step metadata follow AttentionBackend.is_decode (one query token by default).
    assert [CPU.is_decode(n) for n in (1, 2, 5)] == [True, False, False]
    assert CPU.batch_order([3, 1, 2, 1]) == [1, 3, 0, 2]

    class TwoTokenDecodes(CpuAttentionBackend):
        def is_decode(self, num_new_tokens: int) -> bool:
            return num_new_tokens <= 2

    backend = TwoTokenDecodes()
    assert backend.batch_order([3, 1, 2, 1]) == [1, 2, 3, 0]
    cache = backend.allocate_kv_cache(KVSpec(1, KV_HEADS, HEAD_DIM, "float32"), num_blocks=8, block_size=BLOCK)
    # The metadata asks the backend, and the torch kernels refuse what they cannot take rather than misread it.
    with pytest.raises(ValueError, match="one query token per request, not 2"):
        build_attention_metadata([SequenceSlice(([0, 1],), 3, 2)], BLOCK, is_decode=backend.is_decode)
    if backend.use_cpp_kernels:  # the C++ kernel attends every token as its own row: two are two rows
        meta = backend.build_context(cache, [SequenceSlice(([0, 1],), 3, 2)]).group_metadata[0]
        assert meta.num_decode_tokens == 2 and meta.decode.row_pos.tolist() == [3, 4] and not meta.prefills
    meta = build_attention_metadata([SequenceSlice(([0, 1],), 3, 2)], BLOCK, is_decode=lambda n: False)
    assert meta.num_decode_tokens == 0 and len(meta.prefills) == 1
