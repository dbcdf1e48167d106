"""A hybrid model's recurrent state through the engine (kv/state/): the same greedy tokens cold, cached,
batched, chunked, drafted and preempted, with prefix hits that resume from state snapshots, and every slot
accounted for after every step. On a toy hybrid (tests/toy_hybrid.py); the real families (Qwen3.5, LFM2)
run the same checks in tests/engine/test_families.py."""

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError
from tests.engine.spec_decode.test_drafting import OracleProposer
from tests.engine.test_families import greedy, run
from tests.helpers import run_to_finals
from tests.toy_hybrid import toy_hybrid

BLOCK = 4


@pytest.fixture(scope="module")
def toy():
    return toy_hybrid()


def engine_for(loaded, blocks: int = 128, proposer=None, **config) -> Engine:
    from kvserve.kv.cache.kv_spec import kv_spec
    from kvserve.kv.state.state_spec import state_spec

    per_token = kv_spec(loaded.config).bytes_per_token
    slots = config.pop("state_slots", 64)
    memory = blocks * BLOCK * per_token + slots * state_spec(loaded.config).slot_bytes
    config = {"block_size": BLOCK, "kv_cache_memory": memory, "weights_dtype": "float32", "speculative": "off",
              "state_cache_fraction": slots * state_spec(loaded.config).slot_bytes / memory,
              "state_snapshot_tokens": 2 * BLOCK, **config}
    return Engine(EngineConfig(**config), loaded=loaded, proposer=proposer,
                  num_speculative_tokens=4 if proposer else None)


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 26-token prefix (hits end mid-grid), each repeating a phrase (something to draft)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 160, 26).tolist()
    phrases = [rng.integers(1, 160, int(n)).tolist() for n in (4, 5, 6)]
    return [shared + phrase * 3 for phrase in phrases]


@pytest.fixture(scope="module")
def cold(toy):
    return run(engine_for(toy, enable_prefix_caching=False), workload(), one_at_a_time=True)


def test_a_prefix_hit_resumes_the_state_exactly(toy, cold):
    engine = engine_for(toy)
    assert run(engine, workload(), one_at_a_time=True) == cold
    stats = engine.stats()
    # The second and third prompts share 26 tokens: the grid (every 2 blocks = 8 tokens) gives a hit of 24,
    # and the second request's snapshot at its fork (the attention blocks' end, 24 too) is found again.
    assert stats.prefix_cache_hits >= 2 * 24
    states = stats.states
    assert states.num_snapshots > 0 and states.num_live == 0 and states.num_held == 0  # all returned
    assert states.slot_kinds.count("snapshot") == states.num_snapshots
    assert states.slot_bytes == 2 * (32 * 2 + 32) * 4  # 2 recurrent layers x (conv window + sum) x float32


def test_batched_chunked_drafted_and_preempted_requests_keep_the_greedy_tokens(toy, cold):
    assert run(engine_for(toy), workload()) == cold
    assert run(engine_for(toy, max_num_batched_tokens=5), workload()) == cold
    oracle = OracleProposer({tuple(prompt): output for prompt, output in zip(workload(), cold)})
    drafting = engine_for(toy, speculative="ngram", proposer=oracle)
    assert run(drafting, workload()) == cold
    spec = drafting.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # rollbacks happened, and were exact
    preempting = engine_for(toy, blocks=16)
    assert run(preempting, workload()) == cold
    assert preempting.scheduler.num_preemptions > 0


def test_a_chat_turn_resumes_where_the_last_one_ended(toy):
    """Turn two's prompt is turn one's prompt and answer and more: it hits up to turn one's last block boundary,
    past the last grid point."""
    rng = np.random.default_rng(3)
    first = rng.integers(1, 160, 13).tolist()
    engine = engine_for(toy, state_snapshot_tokens=64 * BLOCK)  # no grid point within these lengths
    request = engine.add_request(first, greedy(10))
    answer = list(run_to_finals(engine)[request].outputs[0].token_ids)
    second = first + answer + rng.integers(1, 160, 5).tolist()
    request = engine.add_request(second, greedy(8))
    cached = run_to_finals(engine)[request]
    cold = engine_for(toy, enable_prefix_caching=False)
    reference_id = cold.add_request(second, greedy(8))
    reference = run_to_finals(cold)[reference_id]
    assert list(cached.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    # turn one computed 13 + 9 tokens (its last sampled token was never fed back): its tail is at 20
    assert cached.num_cached_tokens == 20


def test_too_small_a_state_share_is_refused(toy):
    with pytest.raises(ConfigError, match="recurrent states"):
        engine_for(toy, state_slots=1)


def test_the_disk_tier_and_context_shift_are_refused_for_hybrid_models(toy, tmp_path):
    with pytest.raises(ConfigError, match="recurrent-state snapshot"):
        engine_for(toy, kv_disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match="recurrent state"):
        engine_for(toy, context_overflow="shift")


def test_a_hit_cut_short_by_the_state_is_explained_and_the_next_one_is_whole(toy):
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 160, 22).tolist()
    engine = engine_for(toy, state_snapshot_tokens=4 * BLOCK)  # grid every 16 tokens
    run(engine, [shared + rng.integers(1, 160, 6).tolist()], max_tokens=2)  # blocks to 28; snapshots at 16, 28
    report = engine.explain_prompt(shared + rng.integers(1, 160, 6).tolist())
    assert report.num_cached_tokens == 16
    assert "blocks are cached up to token 20" in report.reason and "snapshot is kept at 20" in report.reason
    second = shared + rng.integers(1, 160, 6).tolist()
    request = engine.add_request(second, greedy(2))
    assert run_to_finals(engine)[request].num_cached_tokens == 16  # it writes the fork's snapshot at 20 ...
    request = engine.add_request(shared + rng.integers(1, 160, 6).tolist(), greedy(2))
    assert run_to_finals(engine)[request].num_cached_tokens == 20  # ... which the next request hits
