"""The engine on tiny random models: batch invariance, preemption, chunking, rejection, abort."""

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from tests.helpers import TINY_VOCAB, run_to_finals

BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # tiny models: 3 layers, 2 KV heads, head_dim 16, fp32


def workload(seed=0, count=8):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, TINY_VOCAB, int(n)).tolist() for n in rng.integers(3, 40, count)]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in rng.integers(5, 30, count)]
    return prompts, params


def run_all(engine: Engine, prompts, params) -> dict[str, list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finals = run_to_finals(engine)
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return [finals[i].outputs[0].token_ids for i in ids]


def make_engine(loaded, **config) -> Engine:
    config.setdefault("kv_cache_memory", 256 * 4 * BYTES_PER_TOKEN)
    config.setdefault("block_size", 4)
    return Engine(EngineConfig(**config), loaded=loaded)


@pytest.fixture(scope="module")
def alone(tiny_models):
    """Each workload request run alone, per variant."""
    results = {}

    def get(variant):
        if variant not in results:
            engine = make_engine(tiny_models(variant))
            prompts, params = workload()
            results[variant] = [run_all(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
        return results[variant]

    return get


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-window", "qwen2-bias"])
def test_batched_outputs_equal_outputs_alone(tiny_models, alone, variant):
    engine = make_engine(tiny_models(variant))
    prompts, params = workload()
    assert run_all(engine, prompts, params) == alone(variant)


def test_outputs_survive_repeated_preemption(tiny_models, alone):
    # 14 blocks of 4 tokens for 8 requests of up to 68 tokens: constant preemption.
    engine = make_engine(tiny_models("llama-gqa"), kv_cache_memory=14 * 4 * BYTES_PER_TOKEN)
    assert engine.kv_manager.num_blocks == 14
    prompts, params = workload()
    assert run_all(engine, prompts, params) == alone("llama-gqa")
    assert engine.scheduler.num_preemptions >= 5


@pytest.mark.parametrize("budget", [3, 7, 16])
def test_chunked_prefill_gives_the_same_tokens(tiny_models, alone, budget):
    engine = make_engine(tiny_models("llama-gqa"), max_num_batched_tokens=budget)
    prompts, params = workload()
    assert run_all(engine, prompts, params) == alone("llama-gqa")


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_models):
    prompts, _ = workload(seed=1, count=4)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    engine = make_engine(tiny_models("llama-gqa"))
    together = run_all(engine, prompts, params)
    assert together == [run_all(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]


def test_no_kv_cache_mode_gives_the_same_tokens(tiny_models, alone):
    engine = make_engine(tiny_models("llama-gqa"), enable_kv_cache=False)
    prompts, params = workload()
    assert run_all(engine, prompts[:3], params[:3]) == alone("llama-gqa")[:3]


@pytest.mark.parametrize("prompt,max_tokens,message", [
    ([5] * 250, 10, r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 tokens exceeds the model's context of 256"),
    ([], 5, "the prompt is empty"),
    ([5, TINY_VOCAB], 5, f"token id {TINY_VOCAB} is outside the vocabulary"),
])
def test_invalid_requests_are_rejected_at_add_time(tiny_models, prompt, max_tokens, message):
    engine = make_engine(tiny_models("llama-gqa"))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    assert not engine.has_unfinished()


def test_request_that_cannot_fit_alone_is_rejected(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"), kv_cache_memory=10 * 4 * BYTES_PER_TOKEN)
    with pytest.raises(InvalidRequestError, match="needs 13 KV blocks but the whole cache has 10"):
        engine.add_request([5] * 40, SamplingParams(max_tokens=10))
    engine.add_request([5] * 30, SamplingParams(max_tokens=10))  # 10 blocks: fits, alone
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_duplicate_request_id_is_rejected(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    engine.add_request([1, 2], request_id="x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2], request_id="x")


def test_abort_waiting_prefilling_and_decoding(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"), max_num_batched_tokens=8, max_num_seqs=2)
    decoding = engine.add_request([3] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
    prefilling = engine.add_request([4] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    waiting = engine.add_request([5] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    requests = engine.scheduler.requests
    assert requests[decoding].output_token_ids and 0 < requests[prefilling].num_computed_tokens < 30
    assert requests[waiting].num_computed_tokens == 0
    for request_id in (waiting, prefilling, decoding):
        output = engine.abort(request_id)
        assert output.finished and output.finish_reason == "abort"
        engine.check_integrity()
    assert engine.abort("unknown") is None
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_streamed_deltas_join_to_the_final_output(embedded):
    engine = Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=embedded)
    engine.add_request("Count to five: one, two,", SamplingParams(max_tokens=20, temperature=0.0, stop=["five"]))
    text, ids, final, assembler = "", [], None, RequestOutputAssembler()
    while engine.has_unfinished():
        for delta in engine.step():
            text += delta.new_text
            ids += delta.new_token_ids
            final = assembler.add(delta)
    assert final.finished and text == final.outputs[0].text and ids == final.outputs[0].token_ids
    assert "five" not in text
    assert final.metrics.ttft > 0 and final.kv_cache_bytes > 0


@pytest.mark.parametrize("overcommit", [False, True])
def test_zeroing_the_pool_ahead_commits_all_of_it_unless_it_may_overcommit(tiny_models, overcommit):
    engine = make_engine(tiny_models(), kv_cache_memory=32 << 20, allow_kv_overcommit=overcommit)
    zeroing = engine.kv_cache.zeroing
    assert engine.kv_cache.num_blocks > zeroing.lookahead_blocks  # the two differ here
    while engine.zero_pool_ahead():
        pass
    assert zeroing.zeroed_upto == (zeroing.lookahead_blocks if overcommit else engine.kv_cache.num_blocks)
    request_id = engine.add_request([5, 17, 33, 2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(run_to_finals(engine)[request_id].outputs[0].token_ids) == 6
