"""Gemma 4 through the engine on the paged cache (the issue's own check): a tiny Gemma 4 with sliding layers and
global layers of another head size and fewer KV heads, K = V, two layers reading earlier caches and per-layer
inputs gives transformers' greedy tokens; a second request on the same 150-token prefix hits the prefix cache
exactly (at least 128 tokens cached) and gives the tokens of a cold run; 16-token prefill chunks give the same
tokens; and the pool holds what the layers need: the shared layers nothing, the K = V layers V alone."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, build_hf_model, run_to_finals, save_hf_model

PREFIX, NEW_TOKENS, BLOCK = 150, 12, 16


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    hf = build_hf_model("gemma4")
    return hf, load_model(save_hf_model(hf, tmp_path_factory.mktemp("gemma4-engine")))


def engine(loaded, **options) -> Engine:
    config = {"block_size": BLOCK, "kv_cache_memory": "8MiB", "weights_dtype": "float32", "speculative": "off",
              **options}
    return Engine(EngineConfig(**config), loaded=loaded)


def generate(engine: Engine, prompt: list[int]):
    request = engine.add_request(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    final = run_to_finals(engine)[request]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return list(final.outputs[0].token_ids), final.num_cached_tokens


def prompts() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(11)
    prefix = rng.integers(1, TINY_VOCAB, PREFIX).tolist()
    return prefix + rng.integers(1, TINY_VOCAB, 6).tolist(), prefix + rng.integers(1, TINY_VOCAB, 9).tolist()


def transformers_greedy(hf, prompt: list[int]) -> list[int]:
    """Greedy by hand (generate() would stop at, or with min_new_tokens mask, the EOS the engine ignores)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_prefix_hit_and_chunks_match_transformers_and_a_cold_run(gemma4):
    hf, loaded = gemma4
    first, second = prompts()
    cached = engine(loaded)
    tokens, hit = generate(cached, first)
    assert tokens == transformers_greedy(hf, first) and hit == 0
    tokens, hit = generate(cached, second)  # the shared 150-token prefix: whole blocks of it cached
    assert hit >= 128 and hit == PREFIX // BLOCK * BLOCK
    assert tokens == generate(engine(loaded, enable_prefix_caching=False), second)[0]
    assert tokens == transformers_greedy(hf, second)
    assert generate(engine(loaded, max_num_batched_tokens=16, enable_prefix_caching=False), second)[0] == tokens


def test_the_pool_holds_what_the_layers_need(gemma4):
    _, loaded = gemma4
    config = loaded.config
    spec = kv_spec(config, "float32")
    # 6 layers: 4 store (3 sliding of 2 x 16 for K and V, 1 full K = V of 1 x 32, V alone), 2 read earlier ones
    assert config.kv_source_layers == (0, 1, 2, 3, 3, 2) and spec.num_stored_layers == 4
    stored_bytes = 4 * (3 * 2 * 2 * 16 + 1 * 32)
    assert spec.bytes_per_token == stored_bytes + spec.padding_bytes_per_token()
    assert spec.bytes_per_token == 1024  # 4 slots of 2 rows of 16 per side: the K = V layer fills half of its
    # every layer storing its own K and V: 6 slots
    unshared = kv_spec(replace(config, kv_source_layers=None, layer_k_eq_v=None), "float32")
    assert unshared.bytes_per_token == 4 * (4 * 2 * 2 * 16 + 2 * 2 * 1 * 32) == 1536
