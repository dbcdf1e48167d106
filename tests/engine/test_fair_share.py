"""Fairness between tenants in the scheduler (fake runner, no tensors): a flooding tenant cannot starve another's
admissions or prefill chunks, weights shift the split, one tenant alone keeps the whole budget, `priority`
orders a tenant's own requests, and decodes still go first."""

import pytest

from kvserve.engine.fair_share import FairShare
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sample.sampling import SamplingParams
from tests.engine.test_scheduler import OUTPUTS, counts, make_scheduler, step


def add(scheduler, request_id, prompt_len, tenant, max_tokens=4, priority=0, first_token=1):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, list(range(first_token, first_token + prompt_len)), params,
                      block_size=scheduler.kv.block_size, tenant=tenant, priority=priority)
    OUTPUTS.add(request_id, params)
    scheduler.add(request)
    return request


def tokens_by_tenant(scheduler, out):
    totals = {}
    for item in out.scheduled:
        tenant = scheduler.requests[item.request_id].tenant if item.request_id in scheduler.requests else None
        totals[tenant] = totals.get(tenant, 0) + len(item.token_ids)
    return totals


def test_a_flooding_tenant_does_not_hold_back_anothers_admission():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64)
    for i in range(8):
        add(scheduler, f"a{i}", 200, "A")  # the flood, queued first
    b = add(scheduler, "b", 20, "B")
    out = step(scheduler)
    assert b.status is RequestStatus.RUNNING and counts(out)["b"] == 20  # admitted in the first step
    # b reaches its first token in this step: A gets its half of the step, not what b left (a short step)
    assert tokens_by_tenant(scheduler, out)["A"] == 32
    out = step(scheduler)  # b decodes (1); no first token now: A takes every token the decode left
    assert tokens_by_tenant(scheduler, out) == {"B": 1, "A": 63}


def test_a_prompt_finishing_in_a_later_chunk_keeps_that_step_short_too():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64)
    add(scheduler, "a0", 400, "A")
    b = add(scheduler, "b", 40, "B")
    assert tokens_by_tenant(scheduler, step(scheduler)) == {"A": 32, "B": 32}
    out = step(scheduler)  # b's last 8 prompt tokens (running): its first token, so A gets its half only
    assert counts(out)["b"] == 8 and b.num_computed_tokens == 40
    assert tokens_by_tenant(scheduler, out)["A"] == 32


def test_without_a_first_token_what_one_tenant_leaves_goes_to_the_other():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64)
    add(scheduler, "a0", 400, "A")
    add(scheduler, "b0", 400, "B")
    add(scheduler, "c0", 400, "C")
    scheduler.fair.set_weights({"A": 1.0, "B": 1.0, "C": 2.0})
    by_tenant = tokens_by_tenant(scheduler, step(scheduler))
    assert by_tenant == {"A": 16, "B": 16, "C": 32} and sum(by_tenant.values()) == 64


def test_prefill_chunks_are_split_evenly_between_two_long_prompts():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64)
    add(scheduler, "a0", 400, "A")
    add(scheduler, "a1", 400, "A")
    add(scheduler, "b0", 400, "B")
    for _ in range(3):
        out = step(scheduler)
        by_tenant = tokens_by_tenant(scheduler, out)
        assert by_tenant == {"A": 32, "B": 32}


def test_weights_split_the_budget():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=60)
    scheduler.fair.set_weights({"A": 1.0, "B": 2.0})
    add(scheduler, "a0", 400, "A")
    add(scheduler, "b0", 400, "B")
    by_tenant = tokens_by_tenant(scheduler, step(scheduler))
    assert by_tenant == {"A": 20, "B": 40}


def test_one_tenant_alone_keeps_the_whole_budget():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64)
    add(scheduler, "b0", 10, "B")
    add(scheduler, "a0", 400, "A")
    step(scheduler)  # b0 (10) and a0 (54)
    out = step(scheduler)  # b0 decodes (1), A takes all the rest though B is "owed" nothing more
    assert tokens_by_tenant(scheduler, out) == {"B": 1, "A": 63}


def test_decodes_go_first_and_are_not_shared_out():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=16)
    decoders = [add(scheduler, f"a{i}", 2, "A", max_tokens=10) for i in range(6)]
    step(scheduler)  # six short prompts prefilled
    add(scheduler, "b0", 100, "B")
    out = step(scheduler)
    assert all(counts(out)[r.request_id] == 1 for r in decoders)
    assert counts(out)["b0"] == 10  # what the decodes left
    assert [s.request_id for s in out.scheduled][:6] == [r.request_id for r in decoders]


def test_priority_orders_a_tenants_own_requests_only():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=8, max_num_seqs=2)
    add(scheduler, "a_late", 8, "A", priority=5)
    add(scheduler, "a_urgent", 8, "A", priority=-1)
    add(scheduler, "b0", 8, "B", priority=9)  # B's priority is no claim against A's requests
    out = step(scheduler)
    assert set(counts(out)) == {"a_urgent", "b0"}


def test_preemption_takes_from_the_tenant_holding_the_most_blocks():
    # 10 blocks of 4. A's two requests hold 8, then B's short one (admitted last) takes the last block.
    scheduler = make_scheduler(num_blocks=10, max_num_batched_tokens=64)
    add(scheduler, "a0", 16, "A", max_tokens=8)
    add(scheduler, "a1", 15, "A", max_tokens=8)
    step(scheduler)
    b = add(scheduler, "b", 4, "B", max_tokens=8)
    step(scheduler)
    assert scheduler.kv.num_free_blocks == 0 and scheduler.running[-1] is b
    out = step(scheduler)  # a1 and b each need a block: the most recently admitted (b) is not the one to go
    assert out.preempted == ["a1"]
    assert b.status is RequestStatus.RUNNING and counts(out)["b"] == 1


def test_a_tenant_back_from_idle_does_not_bank_its_idle_time():
    fair = FairShare()
    fair.begin_step({"A"})
    fair.charge("A", 10_000)
    fair.begin_step({"A", "B"})  # B arrives: it starts level with A, not 10,000 tokens ahead
    assert fair.served["B"] == fair.served["A"]


def test_caps_water_fill_what_one_tenant_does_not_need():
    fair = FairShare({"A": 1.0, "B": 1.0, "C": 2.0})
    assert fair.caps({"A": 10, "B": 1000, "C": 1000}, 100) == {"A": 10, "B": 30, "C": 60}
    with pytest.raises(ValueError):
        fair.set_weights({"A": 0})


def _schedule_of(scheduler, request_id, steps=6):
    """Tokens `request_id` got in each of the next steps."""
    return [counts(step(scheduler)).get(request_id, 0) for _ in range(steps)]


def _add_salted(scheduler, request_id, tenant, salt, prompt):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = Request(request_id, prompt, params, cache_salt=salt, block_size=scheduler.kv.block_size, tenant=tenant)
    OUTPUTS.add(request_id, params)
    scheduler.add(request)
    return request


@pytest.mark.parametrize("b_state", ["never", "cached", "in_flight"])
def test_a_tenants_schedule_does_not_depend_on_another_tenants_cache(b_state):
    """Timing leaks nothing across tenants: A's request for prompt P is scheduled the same (tokens per step,
    steps to its first token, cached tokens) whether B never sent P, has P cached, or is computing P right
    now: salts keep their blocks apart, and A never waits on B's in-flight blocks as it would on its own."""
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=16)
    prompt = list(range(100, 140))
    if b_state == "cached":
        _add_salted(scheduler, "b", "B", "salt-b", prompt)
        while scheduler.has_unfinished():
            step(scheduler)
    a = _add_salted(scheduler, "a", "A", "salt-a", prompt)
    if b_state == "in_flight":
        _add_salted(scheduler, "b", "B", "salt-b", prompt)
    schedule = _schedule_of(scheduler, "a")
    assert a.num_cached_tokens == 0
    # Alone, or beside B's own prompt (which takes its fair half of the budget): the same either way for
    # "never" and "cached"; with B computing P too, A still gets its half from the first step, no wait.
    assert schedule[0] > 0
    if b_state != "in_flight":
        assert schedule == [16, 16, 8, 1, 0, 0]


def test_a_step_that_brings_a_first_token_is_not_refilled_by_the_heavy_tenant():
    """B's cached prompt needs 4 tokens, A floods: the step that gives B its first token holds A to its share
    (the leftover B's estimate left is not handed to A), so B's first token does not wait on a full step."""
    from kvserve.config import EngineConfig
    from kvserve.engine.scheduler import Scheduler
    from kvserve.kv.manager import KVCacheManager

    scheduler = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=64),
                          KVCacheManager(256, 4, watermark=0.0, enable_caching=True))
    add(scheduler, "b0", 40, "B", max_tokens=1, first_token=500)
    while scheduler.has_unfinished():
        step(scheduler)
    for i in range(4):
        add(scheduler, f"a{i}", 400, "A", first_token=1000 + 500 * i)
    assert tokens_by_tenant(scheduler, step(scheduler)) == {"A": 64}  # alone: the whole budget
    b = add(scheduler, "b1", 40, "B", max_tokens=1, first_token=500)
    out = step(scheduler)
    assert b.num_cached_tokens == 36 and counts(out)["b1"] == 4
    assert tokens_by_tenant(scheduler, out).get("A") == 32  # its share, no refill to 60
    assert tokens_by_tenant(scheduler, step(scheduler)) == {"A": 64}  # and the whole budget again after
