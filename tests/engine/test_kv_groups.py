"""Sliding windows that free memory, end to end: outputs, block counts per group, planner agreement."""

from dataclasses import replace

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError
from kvserve.kv.groups.layout import max_blocks_held
from kvserve.model.loader import load_model
from kvserve.planner import plan
from tests.helpers import TINY_VOCAB, build_hf_model, run_to_finals, save_hf_model

BS = 4
WINDOW = 6
MIXED = (WINDOW, WINDOW, None, WINDOW, WINDOW, None)  # Gemma 3-like: windowed layers, every third global


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A 6-layer tiny model whose layers attend with MIXED windows: three KV groups of two layers."""
    loaded = load_model(save_hf_model(build_hf_model("llama-6-layers"), tmp_path_factory.mktemp("mixed")))
    for layer, window in zip(loaded.model.layers, MIXED):
        layer.self_attn.sliding_window = window
    return replace(loaded, config=replace(loaded.config, layer_windows=MIXED))


def prompts(count, length, seed=0, shared=0):
    gen = torch.Generator().manual_seed(seed)
    common = torch.randint(0, TINY_VOCAB, (shared,), generator=gen).tolist()
    return [common + torch.randint(0, TINY_VOCAB, (length - shared,), generator=gen).tolist() for _ in range(count)]


def greedy_recompute(model, prompt, max_tokens):
    """The reference: each token from a full forward over the whole sequence (no cache)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor(tokens), torch.arange(len(tokens)))
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


def generate(loaded, token_lists, max_tokens, **config):
    engine = Engine(EngineConfig(block_size=BS, **config), loaded=loaded)
    ids = [engine.add_request(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)) for tokens in token_lists]
    finals = run_to_finals(engine)  # check_integrity() after every step
    return engine, [list(finals[i].outputs[0].token_ids) for i in ids]


def test_the_layout_has_three_groups_and_the_log_says_so(mixed, caplog):
    with caplog.at_level("INFO"):
        engine = Engine(EngineConfig(block_size=BS, kv_cache_memory="1MiB"), loaded=mixed)
    assert engine.kv_spec.layout.describe() == "3 groups of 2 layers: 2 windowed (6 tokens), 1 full attention"
    assert "KV groups: 3 groups of 2 layers" in caplog.text and "blocks behind a window are freed" in caplog.text


def test_long_generations_equal_the_recompute_and_windows_hold_few_blocks(mixed):
    engine = Engine(EngineConfig(block_size=BS, kv_cache_memory="1MiB"), loaded=mixed)
    prompt = prompts(1, 13)[0]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
    windows = engine.kv_spec.layout.windows
    outputs = []
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.extend(delta.new_token_ids)
        engine.check_integrity()
        if engine.has_unfinished():
            held = engine.kv_manager.blocks_held_by_group(request_id)
            computed = engine.stats().requests[0].num_computed_tokens
            for window, blocks in zip(windows, held):
                if window is None:
                    assert blocks == -(-computed // BS)
                else:  # at most ceil((W - 1) / block) + 1 blocks, whatever the length
                    assert blocks <= max_blocks_held(window, BS) == 3
    assert outputs == greedy_recompute(mixed.model, prompt, 40)


@pytest.mark.parametrize("variant", ["mixed", "mistral-window", "gemma3"])
def test_planner_equals_what_the_allocator_holds_at_every_step(mixed, tiny_models, variant):
    loaded = mixed if variant == "mixed" else tiny_models(variant)
    engine = Engine(EngineConfig(block_size=BS, kv_cache_memory="1MiB", max_num_batched_tokens=8), loaded=loaded)
    page = engine.kv_spec.page_bytes(BS)
    engine.add_request(prompts(1, 21)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    seen = set()
    while engine.has_unfinished():
        engine.step()
        for request in engine.stats().requests:
            expected = plan("tiny", loaded.config, 0, context=request.num_computed_tokens, kv_dtype="auto",
                            weights_dtype=loaded.linear_dtype,
                            block_size=BS).kv_bytes_per_request
            assert request.num_blocks * page == expected
            seen.add(request.num_computed_tokens)
    assert len(seen) > 20  # chunked prefill and decode, past the window many times over
    windowed_plan = plan("tiny", loaded.config, 0, context=4096, block_size=BS)
    assert windowed_plan.kv_bytes_per_request < windowed_plan.kv_bytes_per_request_unwindowed


@pytest.mark.parametrize("variant", ["mixed", "gemma3"])
@pytest.mark.parametrize("caching", [True, False])
def test_batching_prefix_hits_and_preemption_do_not_change_outputs(mixed, tiny_models, variant, caching):
    # gemma3: the tiny Gemma 3 (7 layers with an 8-token window, 1 global: eight one-layer groups).
    loaded = mixed if variant == "mixed" else tiny_models(variant)
    token_lists = prompts(6, 23, seed=4, shared=14)
    token_lists += token_lists[:2]  # repeats: hits on prompts cached with their windows freed
    reference = [greedy_recompute(loaded.model, tokens, 12) for tokens in token_lists]
    # A small pool and small chunks: requests preempt one another and evict each other's cached window blocks.
    pages = {"mixed": 24, "gemma3": 64}[variant]  # room for a few requests, not all, and for some cached blocks
    engine, outputs = generate(loaded, token_lists, 12, enable_prefix_caching=caching,
                               kv_cache_memory=pages * loaded_page(loaded), max_num_batched_tokens=8)
    assert outputs == reference
    assert engine.stats().num_preemptions > 0
    if caching:
        assert engine.stats().prefix_cache_hits > 0


def test_the_disk_tier_is_refused_for_windowed_models(mixed, tmp_path):
    with pytest.raises(ConfigError, match="sliding-window layers"):
        Engine(EngineConfig(block_size=BS, kv_cache_memory="1MiB", kv_disk_path=str(tmp_path)), loaded=mixed)


def test_a_context_longer_than_the_pool_fits_when_only_windows_hold_it(tiny_models):
    # Mistral-style: every layer windowed. 200 tokens never hold more than the window plus a chunk.
    loaded = tiny_models("mistral-window")
    engine = Engine(EngineConfig(block_size=BS, kv_cache_memory=12 * loaded_page(loaded), max_num_batched_tokens=8),
                    loaded=loaded)
    assert engine.kv_manager.num_blocks == 12
    request_id = engine.add_request(prompts(1, 60)[0], SamplingParams(max_tokens=140, ignore_eos=True))
    finals = run_to_finals(engine)
    assert len(finals[request_id].outputs[0].token_ids) == 140


def loaded_page(loaded):
    from kvserve.kv.cache.kv_spec import kv_spec

    return kv_spec(loaded.config).page_bytes(BS)
