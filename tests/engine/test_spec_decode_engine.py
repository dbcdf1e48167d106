"""Speculative decoding in the engine, from the config: output equal to drafting off (greedy token for token
on float32 and quantized weights; seeded sampling with penalties, stop strings and logprobs too), draft
slots given back when rejected, abort with drafts in flight, counters."""

import numpy as np
import pytest

from kvserve.arith import cdiv
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.engine.spec_decode import policy as policy_module
from kvserve.engine.spec_decode.policy import DraftPolicy
from kvserve.model.loader import load_model
from tests.engine.spec_decode.test_drafting import OracleProposer, finals_of
from tests.engine.test_engine import BYTES_PER_TOKEN
from tests.helpers import TINY_VOCAB, build_hf_model, save_hf_model
from tests.server.inprocess import with_tiny_tokenizer

CONFIG = {"kv_cache_memory": 256 * 4 * BYTES_PER_TOKEN, "block_size": 4}


def repetitive_prompts(count=5, seed=2):
    """Prompts that repeat a phrase: prompt lookup has something to draft, and greedy tiny models loop."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, TINY_VOCAB, int(n)).tolist() for n in rng.integers(4, 9, count)]
    return [phrase * 4 + phrase[:2] for phrase in phrases]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path_factory.mktemp("spec"))
    return {dtype: with_tiny_tokenizer(load_model(directory, weights_dtype=dtype)) for dtype in ("float32", "auto")}


def run(loaded, prompts, params, **config):
    engine = Engine(EngineConfig(**{**CONFIG, **config}), loaded=loaded)
    return engine, finals_of(engine, prompts, params)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_greedy_output_with_drafting_equals_off(weights, dtype, method):
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    # auto drafts where it pays: at batch 1 on this CPU (engine/spec_decode/policy.py), so one at a time.
    batch = {"max_num_seqs": 1} if method == "auto" else {}
    _, off = run(weights[dtype], prompts, params, speculative="off")
    engine, on = run(weights[dtype], prompts, params, speculative=method, **batch)
    assert [f.outputs[0].token_ids for f in on] == [f.outputs[0].token_ids for f in off]
    spec = engine.stats().spec_decode
    assert spec.num_accepted_tokens > 0  # drafts were verified and accepted, not skipped
    assert spec.num_draft_tokens == sum(f.metrics.num_draft_tokens for f in on)
    assert spec.num_accepted_tokens == sum(f.metrics.num_accepted_draft_tokens for f in on)
    assert sum(spec.acceptance_lengths) == spec.num_drafts


def test_auto_does_not_draft_where_verifying_costs_more_than_it_yields(weights, monkeypatch):
    monkeypatch.setattr(policy_module, "DRAFT_TOKEN_COST", ((1, 0.1), (4, 1.5)))  # batches pay full per token
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine, _ = run(weights["float32"], repetitive_prompts(count=5), params)  # batch 5: verifies cost too much
    assert engine.stats().spec_decode.num_drafts == 0


def test_seeded_sampling_with_penalties_stops_and_logprobs_is_unchanged_by_drafting(weights):
    prompts = repetitive_prompts(count=4, seed=5)
    off_engine = Engine(EngineConfig(**CONFIG, speculative="off"), loaded=weights["float32"])
    plain = finals_of(off_engine, prompts, SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7,
                                                          ignore_eos=True))
    stop = plain[0].outputs[0].text[20:22]
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True,
                            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logprobs=3,
                            stop=[stop])
    off = finals_of(Engine(EngineConfig(**CONFIG, speculative="off"), loaded=weights["float32"]), prompts, params)
    # Drafts that are the output itself (every third one spoiled): long accepted lists and rejections.
    oracle = OracleProposer({tuple(p): f.outputs[0].token_ids for p, f in zip(prompts, off)})
    on = finals_of(Engine(EngineConfig(**CONFIG), loaded=weights["float32"], proposer=oracle,
                          num_speculative_tokens=6), prompts, params)
    for a, b in zip(on, off):
        assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason) == \
            (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason)
        # The same rows' logprobs, computed in a wider forward: equal up to float rounding.
        drafted, plain = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in drafted] == \
            [(lp.token_id, [t for t, _ in lp.top]) for lp in plain]
        assert np.allclose([[lp.logprob] + [v for _, v in lp.top] for lp in drafted],
                           [[lp.logprob] + [v for _, v in lp.top] for lp in plain], atol=1e-4)
    assert 0 < oracle.accepted < oracle.proposed
    assert any(f.outputs[0].finish_reason == "stop" for f in on)


class AlwaysWrong(OracleProposer):
    """Drafts k tokens that are never the model's: every draft spills past the block and is rejected."""

    def propose(self, request_id, token_ids, max_tokens, tenant=None):
        guess = super().propose(request_id, token_ids, max_tokens, tenant)
        return [(token + 1) % TINY_VOCAB for token in guess]


class FixedK(DraftPolicy):
    """k = max_k always, however bad the acceptance."""

    def num_tokens(self, request_id, batch_size):
        return self.max_k


def test_rejected_drafts_in_a_new_block_give_the_block_back(weights):
    prompts = repetitive_prompts(count=2)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _, off = run(weights["float32"], prompts, params, speculative="off")
    wrong = AlwaysWrong({tuple(p): f.outputs[0].token_ids for p, f in zip(prompts, off)})
    engine = Engine(EngineConfig(**CONFIG), loaded=weights["float32"], proposer=wrong, num_speculative_tokens=7)
    engine.drafting.policy = FixedK(7)
    ids = [engine.add_request(p, params) for p in prompts]
    spilled = 0
    while engine.has_unfinished():
        in_flight = {r.request_id: len(r.draft_token_ids) for r in engine.scheduler.running}
        engine.step()
        engine.check_integrity()
        for request in engine.scheduler.running:
            held = engine.kv_manager.num_blocks_held(request.request_id)
            # Only the blocks of the computed tokens are held: the drafts' extra blocks went back.
            assert held == cdiv(request.num_computed_tokens, 4)
            spilled += in_flight.get(request.request_id, 0) >= 4
    assert spilled > 0 and wrong.accepted == 0 < wrong.proposed
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert [engine.scheduler.requests.get(i) for i in ids] == [None, None]


def test_abort_with_drafts_in_flight_frees_everything(weights):
    prompts = repetitive_prompts(count=3)
    engine = Engine(EngineConfig(**CONFIG, speculative="ngram"), loaded=weights["float32"])
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for p in prompts]
    while not any(r.draft_token_ids for r in engine.scheduler.running):
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
        engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("accepted", [True, False])
def test_drafts_across_a_block_boundary_with_int4_keys_and_one_request(weights, accepted):
    """int4 keys keep the block being filled open in float16, one slot per request: a verify that fills it and
    starts the next (k = 3 on blocks of 4) must fit that slot, and change no token, accepted or rejected."""
    prompts = repetitive_prompts(count=2)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    config = {"kv_cache_dtype": "int4", "max_num_seqs": 1}
    _, off = run(weights["float32"], prompts, params, speculative="off", **config)
    expected = {tuple(p): f.outputs[0].token_ids for p, f in zip(prompts, off)}
    proposer = OracleProposer(expected) if accepted else AlwaysWrong(expected)
    engine = Engine(EngineConfig(**{**CONFIG, **config}), loaded=weights["float32"], proposer=proposer,
                    num_speculative_tokens=3)
    engine.drafting.policy = FixedK(3)
    on = finals_of(engine, prompts, params)
    assert [f.outputs[0].token_ids for f in on] == [f.outputs[0].token_ids for f in off]
    assert all(f.outputs[0].finish_reason == "length" for f in on)
    assert (proposer.accepted > 0) == accepted and proposer.proposed > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
