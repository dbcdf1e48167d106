"""`cpu-torch` runs no C++ at all: neither the decode kernel nor its pool's one-pass K/V store."""

import pytest
import torch

from kvserve.kernels import build
from kvserve.kv.attention import SequenceSlice, get_attention_backend
from kvserve.kv.cache.kv_spec import KVSpec


class _Refused:
    """Stands in for the compiled extension: any call into it fails the test."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the C++ kernel {name} was called")


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_torch_backend_step_calls_no_extension_function(monkeypatch, cache_dtype):
    backend = get_attention_backend("cpu-torch")
    monkeypatch.setitem(build._state, "module", _Refused())  # the C++ kernels "built", every call refused
    cache = backend.allocate_kv_cache(KVSpec(1, 2, 16, cache_dtype), num_blocks=16, block_size=4)
    cache.initialize_blocks_through(15)
    generator = torch.Generator().manual_seed(0)
    # Two decodes and a prefill chunk, then the rows a context shift reads and writes back.
    slices = [SequenceSlice(([0, 1],), 5, 1), SequenceSlice(([2, 3],), 7, 1), SequenceSlice(([4, 5, 6],), 0, 9)]
    q = torch.randn(11, 4, 16, generator=generator)
    kv = torch.randn(11, 2, 16, generator=generator)
    out = backend.build_context(cache, slices).attend(0, q, kv, kv, 0.25)
    assert out.shape == (11, 64) and torch.isfinite(out).all()
    slots = backend.token_slots(cache, torch.tensor([4, 5]), torch.tensor([0, 1]))
    cache.write(0, slots, *cache.read_rows(0, slots))


def test_the_cpu_backend_does_call_it(monkeypatch):
    # The stand-in works: the C++ backend reaches it on the same step.
    backend = get_attention_backend("cpu")
    if not backend.use_cpp_kernels:
        pytest.skip("the C++ kernels are not built here")
    cache = backend.allocate_kv_cache(KVSpec(1, 2, 16, "float32"), num_blocks=4, block_size=4)
    cache.initialize_blocks_through(3)
    context = backend.build_context(cache, [SequenceSlice(([0],), 0, 1)])
    monkeypatch.setitem(build._state, "module", _Refused())
    with pytest.raises(AssertionError, match="C\\+\\+ kernel store_kv_ was called"):
        context.attend(0, torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16), 0.25)
