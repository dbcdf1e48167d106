"""Scheduling policy with a fake runner: no model, no tensors."""

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.output.processor import OutputProcessor
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager


def make_scheduler(num_blocks=64, block_size=4, **config):
    config = EngineConfig(block_size=block_size, **config)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, watermark=0.0))


def add(scheduler, request_id, prompt_len, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, list(range(1, prompt_len + 1)), params, block_size=scheduler.kv.block_size)
    OUTPUTS.add(request_id, params)
    scheduler.add(request)
    return request


# Stop conditions (max_tokens here) are the output processor's, as in the engine's step.
OUTPUTS = OutputProcessor(None)


def step(scheduler):
    """One step with a fake runner that samples token 7 for every request that caught up, advanced as
    the engine does: accepted tokens appended (up to a stop), progress recorded, finished requests retired."""
    out = scheduler.schedule()
    for item in out.scheduled:
        request = scheduler.requests[item.request_id]
        kept, reason = OUTPUTS.accept(request, [7]) if item.sample else ([], None)
        scheduler.advance(item, 1 if item.sample else 0, len(kept))
        if reason is not None:
            scheduler.finish(request, reason)
    scheduler.kv.check_integrity()
    return out


def counts(out):
    return {s.request_id: len(s.token_ids) for s in out.scheduled}


def test_budget_and_chunking():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, "a", 25)
    assert counts(step(scheduler)) == {"a": 10}
    assert counts(step(scheduler)) == {"a": 10}
    out = step(scheduler)
    assert counts(out) == {"a": 5} and out.scheduled[0].sample  # the last chunk samples
    assert counts(step(scheduler)) == {"a": 1}  # then decode


def test_decode_first_then_prefill_chunks_then_new_requests_fcfs():
    scheduler = make_scheduler(max_num_batched_tokens=12)
    add(scheduler, "a", 3)
    step(scheduler)  # a prefilled, now decoding
    add(scheduler, "b", 20)
    add(scheduler, "c", 4)
    out = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert counts(out) == {"a": 1, "b": 11}  # decode first, then b takes the rest; c waits (FCFS)
    out = step(scheduler)
    assert counts(out) == {"a": 1, "b": 9, "c": 2}  # b continues before c is admitted
    assert [s.request_id for s in out.scheduled][0] == "a"


def test_max_num_seqs_caps_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 3)
    assert set(counts(step(scheduler))) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preempts_most_recent_and_requeues_it_first():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens use all 6 blocks.
    scheduler = make_scheduler(num_blocks=6)
    a, b, c = add(scheduler, "a", 8, 8), add(scheduler, "b", 8, 8), add(scheduler, "c", 8, 8)
    add(scheduler, "d", 2)
    step(scheduler)  # all three prefilled (and one token each); d cannot be admitted
    assert scheduler.kv.num_free_blocks == 0 and [r.request_id for r in scheduler.waiting] == ["d"]
    out = step(scheduler)  # a needs a 3rd block: c (most recently admitted) is preempted
    assert out.preempted == ["c"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert "c" not in counts(out) and "d" not in counts(out)  # nobody admitted in a preempting step
    assert c.output_token_ids == [7]  # its output so far is kept, to be recomputed


def test_preempted_request_recomputes_prompt_and_outputs():
    scheduler = make_scheduler(num_blocks=6)
    requests = {name: add(scheduler, name, 8, 8) for name in "abc"}
    step(scheduler)
    step(scheduler)  # c is preempted here with one output token
    c = requests["c"]
    for _ in range(50):
        out = step(scheduler)
        if "c" in counts(out):
            break
    # c came back: one step computes its prompt and the output token it already had
    assert counts(out)["c"] == 9
    assert c.num_computed_tokens == 9 and len(c.output_token_ids) == 2
    while scheduler.has_unfinished():
        step(scheduler)
    assert all(len(r.output_token_ids) == 8 for r in requests.values())


def test_a_lone_request_preempts_itself_rather_than_looping():
    scheduler = make_scheduler(num_blocks=2)
    request = add(scheduler, "a", 8, 4)  # exactly 2 blocks for the prompt; no room to grow
    step(scheduler)
    out = step(scheduler)
    assert out.preempted == ["a"] and out.empty
    assert request.status is RequestStatus.WAITING


def test_abort_anywhere_frees_everything():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    a, b = add(scheduler, "a", 3), add(scheduler, "b", 20)
    c = add(scheduler, "c", 4)
    step(scheduler)  # a prefilled, b mid-prefill, c waiting
    assert b.num_computed_tokens == 3 and c.status is RequestStatus.WAITING
    for request in (c, b, a):
        scheduler.finish(request, "abort")
        scheduler.kv.check_integrity()
    assert not scheduler.has_unfinished()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_finished_requests_free_their_blocks():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=3)
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_waits_instead_of_computing_a_prefix_being_computed():
    config = EngineConfig(block_size=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, KVCacheManager(64, 4, watermark=0.0, enable_caching=True))
    a, b = add(scheduler, "a", 20), add(scheduler, "b", 20)  # identical prompts
    c = add(scheduler, "c", 3)
    assert counts(step(scheduler)) == {"a": 20}  # b (and c behind it, FCFS) wait for a's blocks
    out = step(scheduler)
    assert counts(out)["b"] == 4 and b.num_cached_tokens == 16  # b hits a's 4 full blocks
    assert "c" in counts(out)
