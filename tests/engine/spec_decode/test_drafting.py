"""The multi-token step: drafts computed after a request's last token, the agreeing prefix accepted in one
step (stop conditions checked within it), the rest's K/V truncated; the output equals drafting off."""

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from tests.engine.test_engine import BYTES_PER_TOKEN, make_engine
from tests.helpers import TINY_VOCAB
from tests.server.inprocess import with_tiny_tokenizer


class OracleProposer:
    """Proposes the true greedy continuation (known from a run without drafting), every `spoil`-th
    proposal with one wrong token in it, so steps accept whole lists, part of them, or only the model's
    own token."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], spoil: int = 3) -> None:
        self.continuations = continuations
        self.spoil = spoil
        self.num_proposals = 0
        self.proposed = self.accepted = 0
        self.lengths: list[int] = []

    def propose(self, request_id, token_ids, max_tokens, tenant=None):
        for prompt, output in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                guess = list(output[done : done + max_tokens])
                break
        else:
            return []
        self.num_proposals += 1
        if guess and self.num_proposals % self.spoil == 0:
            wrong_at = self.num_proposals % len(guess)
            guess[wrong_at] = (guess[wrong_at] + 1) % TINY_VOCAB
        return guess

    def observe(self, request_id, num_proposed, num_accepted):
        assert 0 <= num_accepted <= num_proposed
        self.proposed += num_proposed
        self.accepted += num_accepted

    def finish(self, request_id, tenant, token_ids, num_prompt_tokens):
        pass


def workload(count=6, seed=1):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, TINY_VOCAB, int(n)).tolist() for n in rng.integers(3, 30, count)]
    return prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def finals_of(engine, prompts, params, per_step=None):
    ids = [engine.add_request(p, params) for p in prompts]
    finals, assembler = {}, RequestOutputAssembler()
    while engine.has_unfinished():
        deltas = engine.step()
        engine.check_integrity()  # drafts' blocks reserved and truncated: accounting holds every step
        for delta in deltas:
            if per_step is not None:
                per_step.append(len(delta.new_token_ids))
            if (final := assembler.add(delta)) is not None:
                finals[final.request_id] = final
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return [finals[i] for i in ids]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return with_tiny_tokenizer(tiny_models("llama-gqa"))


@pytest.mark.parametrize("engine_args", [
    {}, {"max_num_batched_tokens": 7}, {"kv_cache_memory": 24 * 4 * BYTES_PER_TOKEN, "max_num_batched_tokens": 16},
], ids=["plain", "tight-budget", "preempting"])
def test_greedy_output_with_drafts_equals_without(loaded, engine_args):
    prompts, params = workload()
    plain = finals_of(make_engine(loaded, **engine_args), prompts, params)
    oracle = OracleProposer({tuple(p): f.outputs[0].token_ids for p, f in zip(prompts, plain)})
    config = {"kv_cache_memory": 256 * 4 * BYTES_PER_TOKEN, "block_size": 4, **engine_args}
    engine = Engine(EngineConfig(**config), loaded=loaded, proposer=oracle, num_speculative_tokens=5)
    per_step: list[int] = []
    drafted = finals_of(engine, prompts, params, per_step)
    assert [f.outputs[0].token_ids for f in drafted] == [f.outputs[0].token_ids for f in plain]
    assert [f.outputs[0].text for f in drafted] == [f.outputs[0].text for f in plain]
    assert max(per_step) > 1  # some steps accepted several tokens
    assert 0 < oracle.accepted < oracle.proposed  # some drafts were rejected and truncated
    if "kv_cache_memory" in engine_args:
        assert engine.stats().num_preemptions > 0  # preempted with drafts in flight


def test_a_stop_string_inside_an_accepted_list_ends_the_request_there(loaded):
    prompts, params = workload(count=1, seed=3)
    plain = finals_of(make_engine(loaded), prompts, params)[0].outputs[0]
    stop = plain.text[17:19]
    expected = plain.text[: plain.text.index(stop)]

    oracle = OracleProposer({tuple(prompts[0]): plain.token_ids}, spoil=10**9)  # never spoiled: long lists
    engine = Engine(EngineConfig(kv_cache_memory=256 * 4 * BYTES_PER_TOKEN, block_size=4), loaded=loaded,
                    proposer=oracle, num_speculative_tokens=8)
    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    per_step: list[int] = []
    final = finals_of(engine, prompts, stopped, per_step)[0].outputs[0]
    # The step that met the stop string accepted more tokens after it; they were dropped.
    assert final.finish_reason == "stop" and final.text == expected
    stop_token = len(final.token_ids)
    assert final.token_ids == plain.token_ids[:stop_token]
    assert sum(per_step) == stop_token and per_step[-1] > 1  # the stop came inside a multi-token step
    assert oracle.accepted < oracle.proposed  # the drafts after the stop were dropped (their K/V truncated)
