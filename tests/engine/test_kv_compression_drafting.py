"""KV compression with speculative decoding (issue 43): a compressing request's drafts are written after its
compressed prompt (slot = position - dropped), verified over the compressed slots and rolled back by slots; its
tokens are those of drafting off, cold and cached, with ngram, suffix and auto, and every block comes back."""

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.compression import CompressionSpec
from tests.engine.spec_decode.test_drafting import OracleProposer
from tests.engine.spec_decode.test_slots import spy_on_truncate
from tests.engine.test_spec_decode_engine import AlwaysWrong, FixedK, weights  # noqa: F401 (fixture)
from tests.helpers import TINY_VOCAB, run_to_finals

BS, CHUNK = 4, 32
SPEC = CompressionSpec("knorm", 2.0, sinks=2, window=4, chunk=CHUNK)


def compressing_prompts(count=3, length=110, seed=4):
    """Prompts that repeat a phrase past three 32-token chunks (all compressed: the prompt goes on >= 4 tokens
    after them): prompt lookup has something to draft, and greedy tiny models loop."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, TINY_VOCAB, int(n)).tolist() for n in rng.integers(4, 9, count)]
    return [(phrase * (length // len(phrase) + 1))[:length] for phrase in phrases]


def engine_with(loaded, speculative, **overrides) -> Engine:
    config = dict(block_size=BS, kv_cache_memory="2MiB", max_num_batched_tokens=CHUNK, speculative=speculative)
    config.update(overrides)
    engine = Engine(EngineConfig(**config), loaded=loaded)
    engine.compression.default = SPEC  # the flag's chunk is 512: tests use 32-token chunks
    return engine


def cold_then_cached(engine, prompts, params):
    """Each prompt twice on one engine, one at a time: the second run hits the first's compressed blocks."""
    runs = []
    for prompt in prompts:
        for _ in range(2):
            request_id = engine.add_request(prompt, params)
            runs.append(run_to_finals(engine)[request_id])
    return runs


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_compressing_requests_draft_and_answer_as_with_drafting_off(weights, dtype, method):
    prompts = compressing_prompts(count=2)
    off = cold_then_cached(engine_with(weights[dtype], "off"), prompts, GREEDY)
    # auto drafts where it pays: at batch 1 on this CPU (engine/spec_decode/policy.py), one at a time anyway.
    engine = engine_with(weights[dtype], method, max_num_seqs=1)
    on = cold_then_cached(engine, prompts, GREEDY)
    assert [f.outputs[0].token_ids for f in on] == [f.outputs[0].token_ids for f in off]
    assert all(f.num_dropped_tokens == 3 * CHUNK // 2 for f in on)  # three chunks compressed, each to half
    assert [f.num_cached_tokens > 0 for f in on] == [False, True] * len(prompts)  # cold, then cached
    assert sum(f.metrics.num_accepted_draft_tokens for f in on) > 0  # drafted and accepted, not skipped
    assert engine.stats().spec_decode.num_accepted_tokens == sum(f.metrics.num_accepted_draft_tokens for f in on)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_rejected_drafts_roll_back_slots_after_the_compressed_prompt(weights):
    # Drafts that are always wrong, k = 7: every draft spills into a new block and is cut. The tables hold the
    # computed tokens' slots only, and the rolled-back slots the lab is shown are the ones the cut removed.
    prompts = compressing_prompts(count=2, seed=6)
    off = run_all(engine_with(weights["float32"], "off"), prompts)
    wrong = AlwaysWrong({tuple(p): f.outputs[0].token_ids for p, f in zip(prompts, off)})
    engine = Engine(EngineConfig(block_size=BS, kv_cache_memory="2MiB", max_num_batched_tokens=CHUNK),
                    loaded=weights["float32"], proposer=wrong, num_speculative_tokens=7)
    engine.compression.default = SPEC
    engine.drafting.policy = FixedK(7)
    calls = spy_on_truncate(engine)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    cuts = 0
    while engine.has_unfinished():
        calls.clear()
        engine.step()
        engine.check_integrity()
        dropped = 3 * CHUNK // 2
        for request in engine.scheduler.running:
            held = engine.kv_manager.num_blocks_held(request.request_id)
            assert held == -(-(request.num_computed_tokens - engine.kv_manager.dropped_tokens(request.request_id))
                             // BS)
        truncated = {request_id: (before, kept) for request_id, before, kept, _ in calls}
        for r in engine.stats().draft_slots.requests:
            if r.request_id in truncated:
                before, kept = truncated[r.request_id]
                slots = range(kept - dropped, kept - dropped + r.num_rolled_back)
                assert r.rolled_back == tuple((before[s // BS], s % BS) for s in slots)
                cuts += 1
    assert cuts > 0 and wrong.accepted == 0 < wrong.proposed
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert [engine.scheduler.requests.get(i) for i in ids] == [None, None]


def run_all(engine, prompts, params=GREEDY):
    ids = [engine.add_request(p, params) for p in prompts]
    finals = run_to_finals(engine)
    return [finals[i] for i in ids]


def test_oracle_drafts_with_preemptions_answer_as_alone(weights):
    # Long accepted runs and partial ones, in a pool too small for all three: compressing requests are preempted
    # (mid-prefill or mid-decode), recompute or hit their compressed chunks, and draft again.
    loaded = weights["float32"]
    prompts = compressing_prompts(count=3, seed=8)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    alone = [run_all(engine_with(loaded, "off"), [p], params)[0].outputs[0].token_ids for p in prompts]
    oracle = OracleProposer({tuple(p): out for p, out in zip(prompts, alone)})
    page_bytes = engine_with(loaded, "off").kv_spec.page_bytes(BS)
    # 44 blocks: one request's 170 tokens uncompressed (what admission checks), ~31 compressed, not three at once.
    engine = Engine(EngineConfig(block_size=BS, kv_cache_memory=page_bytes * 44, max_num_batched_tokens=3 * CHUNK),
                    loaded=loaded, proposer=oracle, num_speculative_tokens=6)
    engine.compression.default = SPEC
    finals = run_all(engine, prompts, params)
    assert [f.outputs[0].token_ids for f in finals] == alone
    assert engine.scheduler.num_preemptions > 0
    assert 0 < oracle.accepted < oracle.proposed
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_a_cut_into_the_compressed_prompt_starts_the_request_again(weights):
    """No token count names a slot inside a compressed chunk: a cut there goes back to 0, uncompressed, and
    every block returns (the request recomputes, and compresses, its prompt)."""
    engine = engine_with(weights["float32"], "off")
    request_id = engine.add_request(compressing_prompts(count=1)[0], GREEDY)
    while not engine.scheduler.requests[request_id].is_decoding:
        engine.step()
    assert engine.kv_manager.dropped_tokens(request_id) > 0
    assert engine.kv_manager.truncate(request_id, 3 * CHUNK - 1) == 0
    assert engine.kv_manager.dropped_tokens(request_id) == 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    engine.abort(request_id)
    engine.check_integrity()
