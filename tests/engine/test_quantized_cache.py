"""Every cache dtype through the engine: batching, preemption, chunked prefill and prefix caching unchanged.

Quantization is per row, so a row's stored bits do not depend on what else
ran in the step: with any dtype, batched / chunked / preempted / cache-hit
runs must give the tokens the same dtype gives a request run alone.
"""

import pytest

from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.cache.kv_spec import kv_spec
from tests.engine.test_engine import make_engine, run_all, workload
from tests.engine.test_prefix_caching import finish, shared_prompts

DTYPES = ["float16", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2", "int8/int4"]


@pytest.fixture(scope="module")
def alone_by_dtype(tiny_models):
    results = {}

    def get(dtype):
        if dtype not in results:
            engine = make_engine(tiny_models("llama-gqa"), kv_cache_dtype=dtype)
            prompts, params = workload()
            results[dtype] = [run_all(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
        return results[dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_chunked_and_preempted_runs_match_runs_alone(tiny_models, alone_by_dtype, dtype):
    loaded = tiny_models("llama-gqa")
    prompts, params = workload()
    expected = alone_by_dtype(dtype)
    assert run_all(make_engine(loaded, kv_cache_dtype=dtype), prompts, params) == expected
    assert run_all(make_engine(loaded, kv_cache_dtype=dtype, max_num_batched_tokens=7), prompts, params) == expected
    # Fourteen pages of 4 tokens (int4 keys' parameters per block depend on the block size) and, with int4
    # keys, a float16 block being filled beside each (never more of those than pages).
    spec = kv_spec(loaded.config, dtype)
    small = make_engine(loaded, kv_cache_dtype=dtype, kv_cache_memory=14 * (spec.page_bytes(4) + spec.open_block_bytes(4)))
    assert small.kv_manager.num_blocks == 14
    assert run_all(small, prompts, params) == expected
    assert small.scheduler.num_preemptions >= 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hits_read_the_same_quantized_blocks(tiny_models, dtype):
    loaded = tiny_models("llama-gqa")
    cached = make_engine(loaded, kv_cache_dtype=dtype)
    uncached = make_engine(loaded, kv_cache_dtype=dtype, enable_prefix_caching=False)
    prompts = shared_prompts()
    finish(cached, prompts[0])
    for prompt in prompts[1:]:
        hit = finish(cached, prompt)
        assert hit.num_cached_tokens == 24
        assert hit.outputs[0].token_ids == finish(uncached, prompt).outputs[0].token_ids


def test_quantized_caches_hold_more_tokens_in_the_same_memory(tiny_models):
    loaded = tiny_models("llama-gqa")
    budget = 256 * 1024
    # Blocks of 16 (the default): int4 keys' per-channel parameters are spread over a block's rows, and in
    # blocks of 4 they would cost more than int8's one scale per row.
    # blocks of 4 they would cost more than int8's one scale per row. Four requests at once: int4 keeps one
    # float16 block being filled for each beside the pages.
    blocks = {d: make_engine(loaded, kv_cache_dtype=d, kv_cache_memory=budget, block_size=16,
                             max_num_seqs=4).kv_manager.num_blocks
              for d in ["float32", "float16", "int8", "int4"]}
    assert blocks["float32"] < blocks["float16"] < blocks["int8"] < blocks["int4"]
    for dtype, count in blocks.items():
        spec = kv_spec(loaded.config, dtype)
        assert count == (budget - spec.open_blocks_bytes(4, 16)) // spec.page_bytes(16)


def test_int8_greedy_tokens_mostly_follow_float32(tiny_models):
    """Not identical by construction, but an int8 cache should rarely change a greedy choice."""
    loaded = tiny_models("llama-gqa")
    prompts, _ = workload(count=4)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 4
    reference = run_all(make_engine(loaded), prompts, params)
    quantized = run_all(make_engine(loaded, kv_cache_dtype="int8"), prompts, params)
    agree = sum(a == b for r, q in zip(reference, quantized) for a, b in zip(r, q))
    assert agree >= 0.75 * 32
