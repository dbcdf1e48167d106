"""The runner's compaction: per layer and KV head, a chunk's kept rows packed into its first blocks, as stored."""

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.kv.attention import CpuAttentionBackend
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.compressed_chunks import Compaction
from kvserve.kv.compression import CompressionSpec, gather_kept
from kvserve.kv.compression.compact import chunk_slots, compact_chunk, kept_indices

BS, CHUNK, KV_HEADS, D = 4, 16, 2, 16
BACKEND = CpuAttentionBackend()


def cache_of(dtype, num_layers=2):
    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=64,
                         num_layers=num_layers, num_heads=4, num_kv_heads=KV_HEADS, head_dim=D,
                         max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
    cache = BACKEND.allocate_kv_cache(kv_spec(config, dtype), num_blocks=12, block_size=BS, max_num_seqs=2)
    cache.initialize_blocks_through(11)
    return cache


@pytest.mark.parametrize("dtype", ["float32", "int8", "fp8_e4m3", "int8/int4"])
@pytest.mark.parametrize("chunk_index", [0, 1])
def test_kept_rows_are_the_stored_rows_of_gather_kept(dtype, chunk_index):
    cache = cache_of(dtype)
    blocks = [7, 2, 9, 4]  # the chunk's blocks, in token order, anywhere in the pool
    slots = chunk_slots(BACKEND, cache, blocks, CHUNK)
    gen = torch.Generator().manual_seed(chunk_index)
    for layer in range(2):
        k = torch.randn(CHUNK, KV_HEADS, D, generator=gen) * torch.rand(CHUNK, 1, 1, generator=gen) * 3
        cache.write(layer, slots.reshape(-1), k, torch.randn(CHUNK, KV_HEADS, D, generator=gen))
    before = [cache.read_rows(layer, slots.reshape(-1)) for layer in range(2)]  # as stored, decoded
    spec = CompressionSpec("knorm", 2, sinks=2, window=4, chunk=CHUNK)
    compaction = Compaction(chunk_index, chunk_index * CHUNK, tuple(blocks), 2)
    kept = compact_chunk(BACKEND, cache, compaction, spec)
    kept_slots = chunk_slots(BACKEND, cache, blocks[:2], CHUNK // 2)
    positions = torch.arange(chunk_index * CHUNK, (chunk_index + 1) * CHUNK)
    for layer, (k, v) in enumerate(before):
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        indices = kept_indices(keys, values, positions, spec, CHUNK // 2, 2 if chunk_index == 0 else 0)
        assert torch.equal(kept[layer], indices)
        heads_differ = not torch.equal(indices[0], indices[1])
        expected = gather_kept(keys, values, positions, indices)
        got_k, got_v = cache.read_rows(layer, kept_slots.reshape(-1))
        assert torch.equal(got_k.transpose(0, 1), expected.keys) and torch.equal(got_v.transpose(0, 1), expected.values)
    assert heads_differ  # the test moves different rows per head
    if chunk_index == 0:
        assert (kept[0][:, :2] == torch.arange(2)).all()  # the sinks


def test_keeping_every_token_moves_nothing():
    cache = cache_of("int8")
    slots = chunk_slots(BACKEND, cache, [1, 2, 3, 4], CHUNK)
    cache.write(0, slots.reshape(-1), torch.randn(CHUNK, KV_HEADS, D), torch.randn(CHUNK, KV_HEADS, D))
    stored = [t.clone() for t in (cache.k[0], cache.v[0], cache.k_params[0], cache.v_params[0])]
    compact_chunk(BACKEND, cache, Compaction(0, 0, (1, 2, 3, 4), 4), CompressionSpec("keydiff", 1, chunk=CHUNK),
                  layers=range(1))
    assert all(torch.equal(a, b) for a, b in zip(stored, (cache.k[0], cache.v[0], cache.k_params[0],
                                                          cache.v_params[0])))
