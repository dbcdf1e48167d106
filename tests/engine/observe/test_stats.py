"""Engine.stats(): one immutable snapshot between steps; live kv_cache_bytes; integrity errors."""

import dataclasses
import threading

import numpy as np
import pytest

from kvserve.engine.sample.sampling import SamplingParams
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


def test_block_view_is_built_only_when_asked_and_matches_the_pool(tiny_models):
    engine = make_engine(tiny_models("llama-gqa"))
    assert engine.stats().blocks is None
    engine.request_block_view()  # idle: the snapshot is taken at once
    idle = engine.stats().blocks
    assert idle is not None and idle.state_counts() == {"free": engine.kv_manager.num_blocks, "cached": 0,
                                                        "used": 0, "shared": 0}
    shared_prefix = list(range(1, 13))  # three full 4-token blocks
    engine.add_request(shared_prefix + [50], PARAMS, request_id="a")
    engine.step()
    engine.add_request(shared_prefix + [60], PARAMS, request_id="b")
    engine.step()
    assert engine.stats().blocks is idle  # nobody asked: the old view is carried, not rebuilt
    engine.request_block_view()
    engine.step()
    stats = engine.stats()
    view = stats.blocks
    assert view.num_steps == stats.num_steps == 3
    tables = dict(view.tables)
    assert set(tables) == {"a", "b"} and tables["a"][:3] == tables["b"][:3]  # b shares a's prompt blocks
    for block_id in tables["a"][:3]:
        assert view.ref_counts[block_id] == 2 and view.hashed[block_id]
    counts = view.state_counts()
    assert counts["shared"] == 3 and counts["used"] + counts["shared"] == stats.num_used_blocks
    assert counts["free"] + counts["cached"] == stats.num_free_blocks
    assert sum(len(ids) for ids in tables.values()) == sum(r.num_blocks for r in stats.running)
    while engine.has_unfinished():
        engine.step()
    engine.request_block_view()
    done = engine.stats()
    assert done.blocks.state_counts()["cached"] == done.num_cached_free_blocks > 0 and not done.blocks.tables


def test_last_step_counts_computed_and_reused_tokens(tiny_models):
    cached = make_engine(tiny_models("llama-gqa"), enable_prefix_caching=False)
    recompute = make_engine(tiny_models("llama-gqa"), enable_kv_cache=False)
    prompt = list(range(1, 11))
    for engine in (cached, recompute):
        engine.add_request(prompt, PARAMS)
    work = {id(cached): [], id(recompute): []}
    while cached.has_unfinished() or recompute.has_unfinished():
        for engine in (cached, recompute):
            if engine.has_unfinished():
                engine.step()
                step = engine.stats().last_step
                work[id(engine)].append((step.num_tokens, step.num_reused_tokens))
    n = PARAMS.max_tokens
    assert work[id(cached)] == [(10, 0)] + [(1, 10 + k) for k in range(n - 1)]
    assert work[id(recompute)] == [(10 + k, 0) for k in range(n)]  # step k recomputes prompt + k tokens


def test_explain_prompt_reports_hits_and_divergence_without_running(tiny_models):
    from tests.server.inprocess import with_tiny_tokenizer

    engine = make_engine(with_tiny_tokenizer(tiny_models("llama-gqa")))
    first = list(range(1, 21))
    engine.add_request(first, PARAMS)
    while engine.has_unfinished():
        engine.step()
    before = engine.stats()
    same = engine.explain_prompt(first)
    assert same.num_cached_tokens == 16 and same.divergence_position is None  # 4 full blocks, last token computed
    second = first[:10] + [99] + first[11:]
    report = engine.explain_prompt(second)
    assert (report.num_cached_tokens, report.divergence_position) == (8, 10)
    assert report.prompt_snippet == f"{report.common_text}[{report.prompt_continuation}]"
    assert report.common_text and report.prompt_continuation != report.cached_continuation
    assert engine.explain_prompt(first, cache_salt="other").num_cached_tokens == 0  # salts never share
    after = engine.stats()
    assert (after.prefix_cache_queries, after.num_steps) == (before.prefix_cache_queries, before.num_steps)
    engine.check_integrity()
