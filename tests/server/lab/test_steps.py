"""Cached vs recomputed: real steps of two small engines beside the serving one, which stays untouched."""

import asyncio
import json

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.server.lab.steps import StepsBusyError, StepsLimits, StepsRunner
from tests.server.inprocess import assert_idle_and_intact, with_tiny_tokenizer


def run_steps(client, prompt: str, max_tokens: int) -> list[dict]:
    with client.stream("POST", "/lab/api/steps", json={"prompt": prompt, "max_tokens": max_tokens}) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def test_each_step_is_measured_and_recompute_grows_with_k(lab_app):
    prompt = "The capital is where"
    num_prompt = lab_app.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"][
        "prompt_tokens"]
    before = lab_app.get("/lab/api/snapshot").json()
    events = run_steps(lab_app, prompt, 6)
    start, steps, done = events[0], events[1:-1], events[-1]
    assert start["event"] == "start" and start["prompt_tokens"] == num_prompt and done["event"] == "done"
    by_mode = {mode: [e for e in steps if e["mode"] == mode] for mode in ("cached", "recompute")}
    assert [e["step"] for e in by_mode["cached"]] == [e["step"] for e in by_mode["recompute"]] == list(range(6))
    assert [(e["tokens"], e["reused"]) for e in by_mode["recompute"]] == [(num_prompt + k, 0) for k in range(6)]
    assert [(e["tokens"], e["reused"]) for e in by_mode["cached"]] == (
        [(num_prompt, 0)] + [(1, num_prompt + k - 1) for k in range(1, 6)])
    assert all(e["ms"] > 0 and len(e["token_ids"]) == 1 for e in steps)
    # greedy on fp32 weights: the same tokens either way, and they are what the events carried
    assert done["same_output"] and done["token_ids"]["cached"] == [e["token_ids"][0] for e in by_mode["cached"]]
    after = lab_app.get("/lab/api/snapshot").json()
    assert after["step"] == before["step"]  # the serving engine ran no step for it
    assert after["counters"] == before["counters"]
    assert_idle_and_intact(lab_app)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x" * 300, "max_tokens": 4}, "at most 256"),
    ({"prompt": "The", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "The", "max_tokens": 33}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
])
def test_runs_are_bounded(lab_app, body, message):
    response = lab_app.post("/lab/api/steps", json=body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_one_run_at_a_time_and_a_run_finishes_even_if_nobody_reads_it(tiny_models):
    loaded = with_tiny_tokenizer(tiny_models("llama-gqa"))
    runner = StepsRunner(Engine(EngineConfig(kv_cache_memory="1MiB"), loaded=loaded), StepsLimits(64, 8))

    async def scenario():
        runner.start([1, 2, 3, 4], 8)  # nobody reads these events
        with pytest.raises(StepsBusyError):
            runner.start([5, 6, 7], 2)
        while runner.busy:
            await asyncio.sleep(0.01)
        events = [e async for e in runner.start([5, 6, 7], 2)]  # free again, and the engines start clean
        return events

    events = asyncio.run(scenario())
    assert [(e["mode"], e["tokens"]) for e in events if e["event"] == "step"] == [
        ("cached", 3), ("recompute", 3), ("cached", 1), ("recompute", 4)]
    for engine in runner._get_engines().values():
        assert not engine.has_unfinished()
        engine.check_integrity()


def test_steps_compute_one_token_per_step_even_when_the_served_engine_drafts(tiny_models):
    from tests.server.inprocess import serve_in_process

    # ngram drafts from the request's own tokens: a repeating prompt gives it drafts on every step
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")),
                          engine_options={"speculative": "ngram"}) as client:
        events = run_steps(client, "abcabcabcabcabcabcabcabcabcabc", 12)
    cached = [e for e in events[1:-1] if e["mode"] == "cached"]
    assert len(cached) == 12
    assert all(e["tokens"] == 1 and len(e["token_ids"]) == 1 for e in cached[1:]), cached
