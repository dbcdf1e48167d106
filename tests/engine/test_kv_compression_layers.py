"""KV compression beside sliding windows and recurrent state (issue 43): only full-attention layers compress.

The tiny Gemma 3 (seven 8-token-window layers, one global: eight one-layer KV groups) and the tiny hybrids
(Qwen3.5's Gated DeltaNet, LFM2's short convolutions, beside full attention): a compressing request's
full-attention tables count slots, its windowed tables positions, its state every token. Small chunks (16 tokens,
blocks of 4) so that a 60-token prompt compresses three chunks.
"""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine import runner as runner_module
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError
from tests.engine.test_families import make_engine
from tests.engine.test_kv_compression import BS, CHUNK, greedy, prompt, run, spec
from tests.helpers import run_to_finals

VARIANTS = ["gemma3", "qwen35", "lfm2"]


def engine_for(loaded, compression, **config) -> Engine:
    # A hybrid's state snapshots every chunk: hits on a compressed prefix may end at any compressed chunk.
    engine = make_engine(loaded, state_snapshot_tokens=CHUNK, **config)
    engine.compression.default = compression  # the flag's chunk is 512: tests use 16-token chunks
    return engine


@pytest.mark.parametrize("variant", VARIANTS)
def test_keeping_every_token_equals_no_compression_bit_for_bit(tiny_models, variant):
    loaded = tiny_models(variant)
    tokens = prompt(60)
    plain = run(engine_for(loaded, None), tokens)
    kept = run(engine_for(loaded, spec(ratio=1.0)), tokens)
    assert plain[:2] == kept[:2]  # the same tokens and the same logprobs, bit for bit
    assert kept[2].num_dropped_tokens == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_cold_cached_and_chunked_requests_answer_the_same(tiny_models, variant):
    loaded = tiny_models(variant)
    tokens, other = prompt(60, seed=5), prompt(60, seed=5)[:56] + prompt(8, seed=6)
    cold = run(engine_for(loaded, spec()), tokens)
    assert cold[2].num_dropped_tokens == 3 * CHUNK // 2  # three chunks, half of each dropped
    engine = engine_for(loaded, spec())
    first = run(engine, tokens)
    again = run(engine, tokens)
    second = run(engine, other)  # the same three compressed chunks, another tail
    assert first[:2] == cold[:2] == again[:2]  # a hit changes the cost, never the answer
    assert again[2].num_cached_tokens >= 3 * CHUNK  # past the compressed chunks' kept blocks
    assert second[2].num_cached_tokens >= 3 * CHUNK
    assert run(engine_for(loaded, spec()), other)[:2] == second[:2]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    chunked = engine_for(loaded, spec(), max_num_batched_tokens=6)
    assert run(chunked, tokens)[:2] == cold[:2]


@pytest.mark.parametrize("variant", ["qwen35", "lfm2"])
def test_a_hybrid_hit_on_compressed_blocks_resumes_the_snapshot_of_as_many_tokens(tiny_models, variant):
    # A compressing request's state snapshots are keyed by position (kv/prefix/compressed_keys.PositionKeys): a hit
    # ends where the compressed blocks, and a snapshot after exactly as many tokens, are both cached.
    engine = engine_for(tiny_models(variant), spec())
    tokens = prompt(60, seed=9)
    cold = run(engine, tokens)
    request_id = engine.add_request(tokens, greedy())
    first = [token for delta in engine.step() for token in delta.new_token_ids]  # it samples the first token
    request = engine.scheduler.requests[request_id]
    hit = request.num_cached_tokens
    assert hit >= 3 * CHUNK
    keys = engine.kv_manager.prefix.state_keys(request.block_hashes)
    assert engine.kv_manager.states.slots.lookup(keys[hit // BS - 1]) is not None
    finals = run_to_finals(engine)
    assert first + list(finals[request_id].outputs[0].token_ids) == cold[0]
    states = engine.stats().states
    assert states.num_live == states.num_held == 0  # every slot given back


def test_compaction_moves_only_the_full_attention_layers(tiny_models, monkeypatch):
    loaded = tiny_models("gemma3")
    engine = engine_for(loaded, spec(ratio=4.0))
    layout = engine.kv_spec.layout
    full = [index for index, group in enumerate(layout.groups) if group.window is None]
    assert len(layout.groups) > 1 and len(full) == 1
    cache, real = engine.runner.kv_cache, runner_module.compact_chunk
    calls = []

    def watched(backend, kv_cache, compaction, compression, layers):
        # Every windowed block the request holds, each layer's K and V, before and after the move.
        held = [(group, block) for group, table in enumerate(engine.runner._block_tables[request_id])
                if layout.groups[group].window is not None for block in table if block >= 0]
        before = [(kv_cache.k[layer][block].clone(), kv_cache.v[layer][block].clone())
                  for group, block in held for layer in layout.groups[group].layers]
        kept = real(backend, kv_cache, compaction, compression, layers)
        after = [(kv_cache.k[layer][block], kv_cache.v[layer][block])
                 for group, block in held for layer in layout.groups[group].layers]
        assert all(torch.equal(b[0], a[0]) and torch.equal(b[1], a[1]) for b, a in zip(before, after))
        calls.append((compaction.group, tuple(layers), len(held)))
        return kept

    monkeypatch.setattr(runner_module, "compact_chunk", watched)
    request_id = engine.add_request(prompt(60, seed=2), greedy())
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if request_id in engine.scheduler.requests:
            held = engine.kv_manager.blocks_held_by_group(request_id)
            dropped = engine.kv_manager.dropped_tokens(request_id)
            computed = engine.scheduler.requests[request_id].num_computed_tokens
            assert held[full[0]] == -(-(computed - dropped) // BS)  # slots: the dropped tokens hold nothing
            assert all(held[g] <= 4 for g in range(len(held)) if g not in full)  # the window and a chunk
    assert [call[:2] for call in calls] == [(full[0], layout.groups[full[0]].layers)] * 3
    assert all(count > 0 for _, _, count in calls)  # windowed blocks were there, and stayed as they were
    assert cache is engine.runner.kv_cache
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("variant", ["gemma3", "qwen35"])
def test_abort_mid_prefill_returns_every_block_and_state(tiny_models, variant):
    engine = engine_for(tiny_models(variant), spec(ratio=4.0))
    request_id = engine.add_request(prompt(60), greedy())
    for _ in range(3):  # three 16-token chunks computed, two compressed
        engine.step()
        engine.check_integrity()
    assert engine.kv_manager.dropped_tokens(request_id) == 2 * (CHUNK - CHUNK // 4)
    engine.abort(request_id)
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    states = engine.kv_manager.state_stats()
    assert states is None or states.num_live == states.num_held == 0


@pytest.mark.parametrize("variant, blocks", [("gemma3", 11), ("qwen35", 20)])
def test_preempted_compressing_requests_answer_as_alone(tiny_models, variant, blocks):
    # A pool too small for three at once: requests are preempted and come back through their own cached
    # compressed blocks (and windows, or state snapshots), or recompute them, with the same tokens as alone.
    loaded = tiny_models(variant)
    prompts = [prompt(60, seed=20 + i) for i in range(3)]
    alone = [run(engine_for(loaded, spec()), tokens, greedy(12))[0] for tokens in prompts]
    engine = engine_for(loaded, spec(), blocks=blocks, max_num_batched_tokens=24)
    ids = [engine.add_request(tokens, greedy(12)) for tokens in prompts]
    finals = run_to_finals(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [list(finals[i].outputs[0].token_ids) for i in ids] == alone
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_a_model_of_windows_only_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="every layer has a sliding window"):
        Engine(EngineConfig(block_size=BS, kv_cache_memory="2MiB", kv_compression="knorm:2"),
               loaded=tiny_models("mistral-window"))
