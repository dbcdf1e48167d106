"""The C++ paged-decode kernel against per-sequence SDPA: windows, GQA, shared blocks, long and one-token contexts."""

import pytest
import torch

from kvserve.kv.attention import CpuAttentionBackend, PagedKVContext, SequenceSlice, attend, build_attention_metadata
from kvserve.kv.attention.cpu import TorchCpuAttentionBackend
from kvserve.kv.attention.cpu_decode import cpp_decode
from kvserve.kernels import ops
from kvserve.kv.cache.kv_spec import KVSpec
from tests.helpers import write_tokens
from tests.kv.attention.test_cpu import poison, seen

KERNEL = cpp_decode if ops.available() else None  # what the backend's contexts call
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the C++ paged-decode kernel could not be built here "
                                                      "(no compiler or ninja): the torch path is tested elsewhere")


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8", "int4", "int8/int4", "int4/int8"])
# Shapes for each path the kernel dispatches to: the scalar-loop one (head_dim 8 or 16, blocks of 4 or 8),
# and on AVX-512 the grouped one (G * head_dim / 16 <= 16: SmolLM's 9/3 x 64, 12/3 x 32 in blocks of 32,
# 8/8 x 64; in blocks of 128, a run of blocks is cut where its scores would outgrow the kernel's buffer) and
# the per-head one (Llama 3's 4 heads per KV head x 128, Gemma 3's 256).
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [(6, 2, 8, 4), (9, 3, 64, 16), (4, 4, 16, 8),
                                                            (12, 3, 32, 32), (8, 8, 64, 16), (9, 3, 64, 128),
                                                            (8, 2, 128, 16), (4, 1, 256, 16)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_kernel_decode_matches_per_sequence_attention(heads, kv_heads, head_dim, block, window, cache_dtype):
    gen = torch.Generator().manual_seed(heads * block)
    # Tokens cached before this step's one new token: a fresh request, short and long ones, block edges.
    cached_lengths = [0, 3, block - 1, block, 5 * block + 2, 300]
    num_blocks = sum(-(-(n + 1) // block) for n in cached_lengths) + 8
    cache = CpuAttentionBackend().allocate_kv_cache(KVSpec(1, kv_heads, head_dim, cache_dtype), num_blocks, block)
    poison(cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values, slices = [], [], []
    for cached in cached_lengths:
        table = [free.pop() for _ in range(-(-(cached + 1) // block))]
        cache.initialize_blocks_through(max(table))
        k = torch.randn(cached + 1, kv_heads, head_dim, generator=gen)
        v = torch.randn(cached + 1, kv_heads, head_dim, generator=gen)
        if cached:
            write_tokens(cache, 0, table, 0, k[:cached], v[:cached])
        keys.append(k)
        values.append(v)
        slices.append(SequenceSlice((table,), cached, 1))
    meta = build_attention_metadata(slices, block, window)
    q = torch.randn(len(slices), heads, head_dim, generator=gen)
    new_k, new_v = torch.stack([k[-1] for k in keys]), torch.stack([v[-1] for v in values])
    scale = head_dim**-0.5
    out = PagedKVContext(cache, [meta], KERNEL).attend(0, q, new_k, new_v, scale)
    torch_path = PagedKVContext(cache, [meta]).attend(0, q, new_k, new_v, scale)

    for i, (k, v) in enumerate(zip(keys, values)):
        k, v = seen(cache, k, v, len(k) - 1)  # as the cache holds them
        expected = attend(q[i : i + 1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                          torch.tensor([len(k) - 1]), scale, window)
        torch.testing.assert_close(out[i : i + 1], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch_path, rtol=1e-5, atol=1e-5)


def test_requests_sharing_prefix_blocks_read_them_in_place():
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, block = 6, 2, 16, 4
    cache = CpuAttentionBackend().allocate_kv_cache(KVSpec(1, kv_heads, head_dim, "float32"), 32, block)
    poison(cache)
    cache.initialize_blocks_through(31)
    prefix = [3, 7, 11]  # 12 shared tokens, then each request's own block
    k = torch.randn(13, kv_heads, head_dim, generator=gen)
    v = torch.randn(13, kv_heads, head_dim, generator=gen)
    write_tokens(cache, 0, prefix, 0, k[:12], v[:12])
    slices = [SequenceSlice((prefix + [20 + i],), 12, 1) for i in range(4)]
    meta = build_attention_metadata(slices, block)
    assert meta.decode.union_block_ids is not None  # the torch path would take the union kernel
    in_place = build_attention_metadata(slices, block, union_factor=None)  # no union: the C++ kernel runs
    q = torch.randn(4, heads, head_dim, generator=gen)
    new = torch.randn(4, kv_heads, head_dim, generator=gen)
    out = PagedKVContext(cache, [in_place], KERNEL).attend(0, q, new, new * 2, head_dim**-0.5)
    union = PagedKVContext(cache, [meta]).attend(0, q, new, new * 2, head_dim**-0.5)
    torch.testing.assert_close(out, union, rtol=1e-5, atol=1e-5)


def test_the_kernel_reads_shared_blocks_in_place_and_only_the_torch_path_takes_the_union():
    backend = CpuAttentionBackend()
    cache = backend.allocate_kv_cache(KVSpec(1, 2, 8, "float32"), 200, 4)
    shared = list(range(64))  # 256 shared tokens, then each request's own block
    heavy = [SequenceSlice((shared + [100 + i],), 256, 1) for i in range(32)]
    assert backend.build_context(cache, heavy).group_metadata[0].decode.union_block_ids is None
    assert TorchCpuAttentionBackend().build_context(cache, heavy).group_metadata[0].decode.union_block_ids is not None


def test_the_backend_uses_the_kernel_on_every_cache_it_reads():
    backend = CpuAttentionBackend()
    slices = [SequenceSlice(([0],), 0, 1)]
    for dtype, expected in [("float32", KERNEL), ("float16", KERNEL), ("bfloat16", KERNEL), ("int8", KERNEL),
                            ("int4", KERNEL), ("int8/int4", KERNEL), ("fp8_e4m3", None), ("float16/int4", None)]:
        cache = backend.allocate_kv_cache(KVSpec(1, 2, 8, dtype), 4, 4)
        assert backend.build_context(cache, slices).decode_kernel is expected
