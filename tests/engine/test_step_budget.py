"""The step-time target in tokens (engine/step_budget.py) and the scheduler's cut while several requests have work:
measured rate -> tokens, a lone request keeps the whole budget, decodes count against the cut, prefill never
stops."""

from kvserve.engine.step_budget import MIN_SAMPLE_TOKENS, StepBudget, prefill_budget
from tests.engine.test_fair_share import add
from tests.engine.test_scheduler import counts, make_scheduler, step


def test_no_cut_before_a_step_is_measured_or_when_turned_off():
    assert StepBudget(150, 2048, 16).contended_tokens() is None
    off = StepBudget(0, 2048, 16)
    off.observe(1000, 1.0)
    assert off.contended_tokens() is None


def test_the_measured_rate_turns_the_target_into_tokens():
    budget = StepBudget(150, 2048, 16)
    budget.observe(1000, 1.0)  # 1 ms a token
    assert budget.contended_tokens() == 150
    budget.observe(MIN_SAMPLE_TOKENS - 1, 10.0)  # a few decodes: mostly fixed cost, not a sample
    assert budget.contended_tokens() == 150
    budget.observe(100, 0.2)  # slower now (2 ms a token): the average moves towards it
    assert 75 < budget.contended_tokens() < 150


def test_the_cut_stays_within_a_block_and_the_step_budget():
    slow = StepBudget(150, 2048, 16)
    slow.observe(100, 100.0)  # a second a token
    assert slow.contended_tokens() == 16
    fast = StepBudget(150, 2048, 16)
    fast.observe(10_000, 0.001)
    assert fast.contended_tokens() == 2048


def test_prefill_budget_counts_the_decodes_against_the_cut():
    assert prefill_budget(2048, 2048, None, 16) == 2048  # no cut
    assert prefill_budget(2040, 2048, 100, 16) == 92  # 8 decodes took their share of the 100
    assert prefill_budget(1948, 2048, 100, 16) == 16  # the decodes alone fill it: prefill still moves
    assert prefill_budget(10, 2048, 100, 16) == 10  # never more than the step has left


def test_the_scheduler_cuts_prefill_only_while_several_requests_have_work():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=256)
    scheduler.contended_budget = 48
    add(scheduler, "a0", 400, "A")
    assert counts(step(scheduler)) == {"a0": 256}  # alone: the whole budget
    add(scheduler, "a1", 400, "A")
    assert sum(counts(step(scheduler)).values()) == 48  # two with work: the step is cut
    scheduler.contended_budget = None
    assert sum(counts(step(scheduler)).values()) == 256


def test_the_engine_measures_its_steps_and_cuts_them_while_several_requests_have_work(tiny_models):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.engine.sample.sampling import SamplingParams

    engine = Engine(EngineConfig(kv_cache_memory="16MiB", max_num_batched_tokens=128, step_target_ms=150),
                    loaded=tiny_models("llama-gqa"))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([3 + i % 150 for i in range(100)], params)
    engine.step()  # alone: no cut, and the step is measured
    assert engine.step_budget.seconds_per_token is not None
    engine.step_budget.seconds_per_token = 0.150 / 40  # as if a token took 3.75 ms: 40 tokens fit the target
    engine.add_request([5 + i % 150 for i in range(180)], params)
    engine.add_request([7 + i % 150 for i in range(190)], params)
    engine.step()
    assert engine.scheduler.contended_budget == 40
    assert engine.stats().last_step.num_tokens == 40  # one decode and 39 prompt tokens, not 128
