"""Engine.stats(): one immutable snapshot between steps; live kv_cache_bytes; integrity errors."""

import dataclasses
import threading

import numpy as np
import pytest

from kvserve.engine.sampling import SamplingParams
from kvserve.errors import KVIntegrityError
from tests.engine.test_engine import BYTES_PER_TOKEN, make_engine
from tests.helpers import TINY_VOCAB

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
BLOCK = 4 * BYTES_PER_TOKEN  # bytes of one 4-token block


def test_snapshot_counts_blocks_and_requests_step_by_step(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    prompts = {"a": list(range(1, 11)), "b": list(range(20, 26)), "c": list(range(1, 14))}  # c shares a's blocks
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, PARAMS, request_id=request_id)
    queued = engine.stats()
    assert (queued.num_running, queued.num_waiting, queued.num_used_blocks) == (0, 3, 0)
    assert [(r.request_id, r.status, r.num_blocks) for r in queued.waiting] == [("a", "waiting", 0), ("b", "waiting", 0),
                                                                              ("c", "waiting", 0)]
    outputs = {o.request_id: o for o in engine.step()}
    stats = engine.stats()
    # c waits a step: a is computing the blocks c would hit
    assert [r.request_id for r in stats.running] == ["a", "b"] and [r.request_id for r in stats.waiting] == ["c"]
    for entry in stats.running:
        prompt_len = len(prompts[entry.request_id])
        assert entry.status == "decoding" and entry.num_output_tokens == 1 and entry.ttft > 0
        assert (entry.num_prompt_tokens, entry.num_computed_tokens) == (prompt_len, prompt_len)
        assert entry.num_blocks == -(-prompt_len // 4)
        assert outputs[entry.request_id].kv_cache_bytes == entry.num_blocks * BLOCK > 0  # live, not 0 while running
    assert stats.num_used_blocks == 3 + 2 and stats.num_free_blocks == stats.num_blocks - stats.num_used_blocks
    assert (stats.num_steps, stats.num_generated_tokens, stats.prefix_cache_queries) == (1, 2, 10 + 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_steps = 0

    outputs = {o.request_id: o for o in engine.step()}
    after = engine.stats()
    c = after.request("c")
    assert (c.status, c.num_cached_tokens, c.num_blocks, c.num_output_tokens) == ("decoding", 8, 4, 1)
    assert outputs["c"].kv_cache_bytes == 4 * BLOCK
    assert after.num_used_blocks == 3 + 2 + 2  # c's first two blocks are a's: the pool counts them once
    assert (after.prefix_cache_queries, after.prefix_cache_hits, after.num_generated_tokens) == (29, 8, 5)

    finals = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert stats.num_steps == 1 and stats.num_running == 2  # an old snapshot never changes under its reader
    done = engine.stats()
    assert done.num_running == done.num_waiting == done.num_used_blocks == 0
    assert done.num_free_blocks == done.num_blocks and done.num_generated_tokens == 3 * 5
    assert done.num_cached_free_blocks == done.num_cached_blocks > 0  # every cached prefix is free, still reusable
    # at finish: what it held when it finished (prompt + 4 computed outputs)
    assert finals["a"].kv_cache_bytes == -(-(10 + 4) // 4) * BLOCK


def test_abort_and_preemption_show_in_the_snapshot(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"), kv_cache_memory=40 * 4 * BYTES_PER_TOKEN,
                         enable_prefix_caching=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(np.random.default_rng(i).integers(1, TINY_VOCAB, 30).tolist(), params)
    engine.add_request([1, 2, 3], params, request_id="gone")
    engine.abort("gone")
    assert engine.stats().request("gone") is None and engine.stats().num_waiting == 6
    statuses = set()
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        statuses |= {r.status for r in stats.requests}
        assert stats.num_preemptions == engine.scheduler.num_preemptions
        # no sharing without prefix caching: the requests' blocks add up to the pool's used blocks
        assert sum(r.num_blocks for r in stats.requests) == stats.num_used_blocks
        assert all(r.num_blocks == 0 for r in stats.waiting)
    assert stats.num_preemptions > 0 and {"preempted", "decoding", "waiting"} <= statuses


def test_stats_can_be_read_while_a_step_runs(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    for i in range(4):
        engine.add_request(list(range(1 + i, 30 + i)), PARAMS)
    stop, seen, problems = threading.Event(), [], []

    def read():
        while not stop.is_set():
            stats = engine.stats()
            if stats.num_used_blocks + stats.num_free_blocks != stats.num_blocks:
                problems.append(stats)
            seen.append(stats.num_steps)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        stop.set()
        reader.join()
    assert not problems and seen == sorted(seen)


def test_engine_integrity_check_raises_kv_integrity_error(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    engine.check_integrity()
    engine.kv_manager.pool.allocate(1)  # a block nobody's table holds: a leak
    with pytest.raises(KVIntegrityError, match="held by 0 tables"):
        engine.check_integrity()
