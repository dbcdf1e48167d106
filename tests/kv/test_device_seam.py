"""The device seam: the pool, its block copies and a step's attention metadata create every tensor on the
cache's device, naming it (tests/device_guard.py); the guard itself catches a tensor created without one."""

import pytest
import torch

from kvserve.kv.attention import SequenceSlice
from kvserve.kv.attention.registry import ATTENTION_BACKENDS
from kvserve.kv.cache.kv_spec import KVSpec
from tests.device_guard import DeviceGuard

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4


def test_the_guard_records_a_tensor_that_names_no_device_or_lands_elsewhere():
    with DeviceGuard("cpu") as guard:
        torch.zeros(3, device="cpu")  # fine
        torch.arange(4)  # lands on the CPU, but only because the default device is the CPU
        torch.empty(2, device="meta")  # named, but elsewhere
        torch.zeros_like(torch.ones(2, device="cpu"))  # inherits its input's device: not a factory call here
    assert [(v.factory, v.named_device, v.device.type) for v in guard.violations] == [
        ("arange", False, "cpu"), ("empty", True, "meta")]
    assert "test_device_seam.py" in guard.violations[0].where and "arange" in guard.report()


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "int4", "fp8_e4m3", "int8/int4"])
def test_pool_blocks_and_step_contexts_build_nothing_off_the_device(backend, cache_dtype):
    attention = ATTENTION_BACKENDS[backend]()
    generator = torch.Generator().manual_seed(0)
    with DeviceGuard("cpu") as guard:
        # Two kinds of layers (a window on layer 1): metadata per group, each its own tables.
        spec = KVSpec(2, KV_HEADS, HEAD_DIM, cache_dtype, layer_windows=(None, 6))
        cache = attention.allocate_kv_cache(spec, num_blocks=40, block_size=BLOCK, device="cpu")
        cache.initialize_blocks_through(39)
        tables = [list(range(10)), list(range(10, 20))]
        prefill = [SequenceSlice(tables, 0, 9)]
        decodes = [SequenceSlice(tables, 9, 1), SequenceSlice([list(range(20, 24)), list(range(24, 28))], 3, 1),
                   SequenceSlice([list(range(28, 34)), list(range(34, 40))], 12, 5)]  # plus one prefill chunk
        for slices in (prefill, decodes):
            num_tokens = sum(s.num_new_tokens for s in slices)
            context = attention.build_context(cache, slices)
            for layer in range(2):
                q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=generator, device="cpu")
                kv = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator, device="cpu")
                assert context.attend(layer, q, kv, kv, HEAD_DIM**-0.5).shape == (num_tokens, HEADS * HEAD_DIM)
        slots = attention.token_slots(cache, torch.tensor([3, 4], device="cpu"), torch.tensor([0, 1], device="cpu"))
        k, v = cache.read_rows(0, slots)
        cache.write(1, slots, k, v)
        payloads = cache.read_blocks([1, 2])
        cache.write_blocks([30, 31], payloads)
    assert not guard.violations, guard.report()


def test_the_pool_and_step_metadata_follow_the_device_they_are_given():
    # The meta device stands in for a GPU: a tensor built without the device would land on the CPU.
    from kvserve.kv.attention import build_attention_metadata
    from kvserve.kv.attention.cpu import CpuAttentionBackend, slot_indices

    with DeviceGuard("meta") as guard:
        cache = CpuAttentionBackend().allocate_kv_cache(KVSpec(1, KV_HEADS, HEAD_DIM, "int8"), 16, BLOCK,
                                                        device="meta")
        cache.initialize_blocks_through(15)
        slices = [SequenceSlice(([0, 1],), 5, 1), SequenceSlice(([2, 3, 4],), 0, 10)]
        meta = build_attention_metadata(slices, BLOCK, union_factor=None, device=cache.device)
        slots = slot_indices(meta.slot_blocks, meta.slot_rows, KV_HEADS, BLOCK)
    assert not guard.violations, guard.report()
    assert cache.device.type == "meta" and all(t.is_meta for t in cache.k + cache.v + cache.k_params)
    decode, prefill = meta.decode, meta.prefills[0]
    step_tensors = [meta.slot_blocks, meta.slot_rows, slots, decode.block_ids, decode.seq_index, decode.key_valid,
                    decode.seq_offsets, prefill.block_ids, prefill.positions]
    assert all(t.is_meta for t in step_tensors)
