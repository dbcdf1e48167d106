"""Prefix caching through the engine: same outputs, reported hits, salts, opt-out, chats, explanations."""

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from tests.engine.test_engine import BYTES_PER_TOKEN, make_engine
from tests.helpers import TINY_VOCAB, run_to_finals

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def finish(engine, prompt, params=GREEDY, **kwargs):
    request_id = engine.add_request(prompt, params, **kwargs)
    return run_to_finals(engine)[request_id]


def shared_prompts(count=4, prefix_len=26, suffix_len=5):
    rng = np.random.default_rng(5)
    prefix = rng.integers(1, TINY_VOCAB, prefix_len).tolist()
    return [prefix + rng.integers(1, TINY_VOCAB, suffix_len).tolist() for _ in range(count)]


def test_hits_give_the_same_tokens_as_cold_runs_and_cache_off(tiny_models):
    loaded = tiny_models("llama-gqa")
    cached = make_engine(loaded)
    uncached = make_engine(loaded, enable_prefix_caching=False)
    prompts = shared_prompts()
    first = finish(cached, prompts[0])
    assert first.num_cached_tokens == 0
    for prompt in prompts[1:]:
        hit = finish(cached, prompt)
        assert hit.num_cached_tokens == 24  # six full 4-token blocks of the 26-token shared prefix
        assert hit.outputs[0].token_ids == finish(uncached, prompt).outputs[0].token_ids
    assert cached.stats().prefix_cache_hits == 3 * 24 and cached.stats().prefix_cache_queries == 4 * 31
    assert uncached.stats().prefix_cache_hits == 0 and finish(uncached, prompts[0]).num_cached_tokens == 0


def test_counters_are_monotonic(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    seen = []
    for prompt in shared_prompts(3) * 2:
        finish(engine, prompt)
        seen.append((engine.stats().prefix_cache_queries, engine.stats().prefix_cache_hits))
    assert seen == sorted(seen) and seen[-1][1] > 0


def test_salts_isolate_and_opt_out_skips_reading(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    prompt = shared_prompts(1)[0]
    finish(engine, prompt, cache_salt="alice")
    assert finish(engine, prompt, cache_salt="bob").num_cached_tokens == 0
    assert finish(engine, prompt, cache_salt="alice").num_cached_tokens == 28
    opted_out = finish(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      skip_reading_prefix_cache=True), cache_salt="alice")
    assert opted_out.num_cached_tokens == 0
    assert opted_out.prefix_cache.reason == "this request skipped reading the cache"


def test_preempted_requests_recompute_from_cache_hits(tiny_models):
    loaded = tiny_models("llama-gqa")
    prompts = [np.random.default_rng(i).integers(1, TINY_VOCAB, 30).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    computed, outputs = {}, {}
    for caching in (True, False):
        engine = make_engine(loaded, kv_cache_memory=40 * 4 * BYTES_PER_TOKEN, enable_prefix_caching=caching)
        schedule, total = engine.scheduler.schedule, []

        def counting_schedule(schedule=schedule, total=total):
            out = schedule()
            total.append(out.num_batched_tokens)
            return out

        engine.scheduler.schedule = counting_schedule
        for prompt in prompts:
            engine.add_request(prompt, params)
        done = {i: final.outputs[0].token_ids for i, final in run_to_finals(engine).items()}
        assert engine.scheduler.num_preemptions > 0
        computed[caching], outputs[caching] = sum(total), done
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False]  # recompute after preemption was served from the cache


@pytest.fixture(scope="module")
def chat_engine(embedded):
    return Engine(EngineConfig(kv_cache_memory="128MiB"), loaded=embedded)


@pytest.mark.slow
def test_chat_turns_reuse_their_history(chat_engine):
    tokenizer = chat_engine.tokenizer
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    cached, prompt_lengths = [], []
    for question in ["Name a fruit.", "What color is it?", "Is it sweet?", "Where does it grow?"]:
        messages.append({"role": "user", "content": question})
        prompt = tokenizer.encode_chat(messages)
        result = finish(chat_engine, prompt, SamplingParams(max_tokens=24, temperature=0.0))
        cached.append(result.num_cached_tokens)
        prompt_lengths.append(len(prompt))
        messages.append({"role": "assistant", "content": result.outputs[0].text})
    assert cached == sorted(cached) and len(set(cached)) == 4  # grows every turn
    # blocks filled while decoding turn N are hits for turn N+1: more than the previous prompt is cached
    assert any(cached[i + 1] > prompt_lengths[i] for i in range(3))


@pytest.mark.slow
def test_miss_explanation_points_at_the_differing_token(chat_engine):
    tokenizer = chat_engine.tokenizer
    template = "System prompt for ACME support. Current time: 2026-11-21 {}. Be brief and friendly to every user."
    first = tokenizer.encode(template.format("10:15:02") + " Question one?")
    second = tokenizer.encode(template.format("10:47:02") + " Question one?")
    position = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert position % 16 not in (0, 15)  # the difference sits inside a block
    finish(chat_engine, first)
    report = finish(chat_engine, second).prefix_cache
    assert report.divergence_position == position
    assert report.num_cached_tokens == position // 16 * 16
    assert f"at token {position}" in report.reason
    assert report.prompt_snippet.endswith("]") and "4" in report.prompt_snippet.split("[")[1]
    assert "1" in report.cached_snippet.split("[")[1]
    assert "this prompt" in report.describe()
