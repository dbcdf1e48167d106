"""Blocks copied out of the pool and back (what the disk tier stores and loads), byte for byte, per KV dtype."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from tests.test_huge_pages import THP, madvised_huge


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


@pytest.mark.parametrize("dtype", ["auto", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "int8/int4"])
def test_read_blocks_then_write_blocks_copies_every_byte(tiny_models, dtype):
    cache = Engine(EngineConfig(kv_cache_memory=1 << 20, kv_cache_dtype=dtype), loaded=tiny_models("llama-gqa")).kv_cache
    cache.initialize_blocks_through(12)
    generator = torch.Generator().manual_seed(0)
    tensors = cache.k + cache.v + cache.k_params + cache.v_params
    for tensor in tensors:
        raw(tensor)[:12].copy_(torch.randint(0, 256, raw(tensor)[:12].shape, generator=generator, dtype=torch.uint8))
    payloads = cache.read_blocks([3, 7, 1])
    assert [len(p) for p in payloads] == [cache.block_nbytes] * 3
    assert len(cache.block_layout()) == len(tensors)
    cache.write_blocks([20, 21, 22], [bytes(p) for p in payloads])  # past the zeroed blocks: not wiped later
    cache.initialize_blocks_through(40)
    for tensor in tensors:
        assert torch.equal(raw(tensor)[[3, 7, 1]], raw(tensor)[[20, 21, 22]])


def test_write_blocks_refuses_a_payload_of_another_size(tiny_models):
    cache = Engine(EngineConfig(kv_cache_memory=1 << 20), loaded=tiny_models("llama-gqa")).kv_cache
    with pytest.raises(ValueError, match="payloads of"):
        cache.write_blocks([1], [b"\0" * (cache.block_nbytes - 1)])


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here")
@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_a_large_pool_lies_on_huge_pages(tiny_models, dtype):
    # Every decode step reads the blocks again (kvserve/huge_pages.py).
    large = Engine(EngineConfig(kv_cache_memory=256 << 20, kv_cache_dtype=dtype), loaded=tiny_models("llama-gqa")).kv_cache
    assert all(madvised_huge(tensor.data_ptr()) for tensor in large.k + large.v)
    assert all(madvised_huge(tensor.data_ptr()) for tensor in large.k_params + large.v_params if tensor.nbytes >= 2 << 20)
