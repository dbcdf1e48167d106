"""Every family through the engine, on tiny random models and the default (float32) weights: a cache hit, a
chunked prefill, speculative decoding and preemption change the cost, never the greedy tokens; structured
output, the context shift and the disk tier work for each. A family adds its tiny variant to FAMILY_VARIANTS."""

import re

import numpy as np
import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError
from kvserve.kv.attention.contiguous import ContiguousContext
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.state_spec import state_spec
from kvserve.structured.params import StructuredOutputsParams as Spec
from tests.engine.spec_decode.test_drafting import OracleProposer
from tests.helpers import TINY_VOCAB, run_to_finals
from tests.server.inprocess import with_tiny_tokenizer

# One tiny variant per family (tests/helpers.py, tests/dense_variants.py).
FAMILY_VARIANTS = ["llama-gqa", "gemma3", "qwen3", "qwen3-moe", "smollm3", "phi4-mini-longrope", "olmo2", "granite", "granite4-dense",
                   "ministral3", "qwen35", "lfm2", "gemma4", "gemma4-full", "gemma4-moe"]
STATE_SLOTS = 32  # a hybrid model's recurrent states, beside the blocks
BLOCK = 4


def make_engine(loaded, blocks: int = 128, disk=None, proposer=None, **config) -> Engine:
    per_token = kv_spec(loaded.config).bytes_per_token
    states = state_spec(loaded.config)
    state_bytes = STATE_SLOTS * states.slot_bytes if states is not None else 0
    memory = blocks * BLOCK * per_token + state_bytes
    # (a byte more, so that rounding gives exactly STATE_SLOTS and the blocks the rest)
    fraction = (state_bytes + 1) / memory if states is not None else 0.5
    config = {"block_size": BLOCK, "kv_cache_memory": memory, "weights_dtype": "float32",
              "speculative": "off", "state_cache_fraction": fraction, **config}
    return Engine(EngineConfig(kv_disk_path=str(disk) if disk else None, **config), loaded=loaded,
                  proposer=proposer, num_speculative_tokens=4 if proposer else None)


def smallest_engine(loaded, prompts: list[list[int]], max_tokens: int = 20) -> Engine:
    """An engine whose pool holds the largest of these requests and little more: the others preempt it."""
    for blocks in range(8, 64):
        engine = make_engine(loaded, blocks=blocks)
        chunk = engine.config.max_num_batched_tokens
        if all(engine.kv_manager.can_fit(len(prompt) + max_tokens, chunk) for prompt in prompts):
            return engine
    raise AssertionError("no pool of under 64 blocks fits the workload")


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 24-token prefix (prefix-cache hits), each repeating a phrase (something to draft)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, TINY_VOCAB, 24).tolist()
    phrases = [rng.integers(1, TINY_VOCAB, int(n)).tolist() for n in (4, 5, 6)]
    return [shared + phrase * 3 for phrase in phrases]


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompts: list[list[int]], one_at_a_time: bool = False, max_tokens: int = 20) -> list[list[int]]:
    ids, finals = [], {}
    for prompt in prompts:
        ids.append(engine.add_request(prompt, greedy(max_tokens)))
        if one_at_a_time:
            finals.update(run_to_finals(engine))
    finals.update(run_to_finals(engine))
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks  # every block came back
    return [list(finals[i].outputs[0].token_ids) for i in ids]


@pytest.fixture(scope="module")
def cold(tiny_models):
    """Each variant's workload, one request at a time with no prefix cache: the reference."""
    return {variant: run(make_engine(tiny_models(variant), enable_prefix_caching=False), workload(), True)
            for variant in FAMILY_VARIANTS}


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_cache_hits_chunks_drafts_and_preemption_keep_the_greedy_tokens(tiny_models, cold, variant):
    loaded = tiny_models(variant)
    cached = make_engine(loaded)
    assert run(cached, workload(), one_at_a_time=True) == cold[variant]
    assert cached.stats().prefix_cache_hits > 0
    assert run(make_engine(loaded, max_num_batched_tokens=16), workload()) == cold[variant]
    # drafts from an oracle (the true continuation, one in three spoiled): whole, partial and no acceptance
    oracle = OracleProposer({tuple(prompt): output for prompt, output in zip(workload(), cold[variant])})
    drafting = make_engine(loaded, speculative="ngram", proposer=oracle)
    assert run(drafting, workload()) == cold[variant]
    assert 0 < drafting.stats().spec_decode.num_accepted_tokens < drafting.stats().spec_decode.num_draft_tokens
    # (a hybrid model's requests share no blocks until a fork snapshot exists: two must fit to run together)
    preempting = make_engine(loaded, blocks=24) if loaded.model.has_recurrent_state else smallest_engine(loaded, workload())
    assert run(preempting, workload()) == cold[variant]
    # (a windowed model's requests free their blocks behind the window and fit this pool side by side)
    assert preempting.scheduler.num_preemptions > 0 or any(loaded.model.layer_windows)


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_structured_output(tiny_models, variant):
    engine = make_engine(with_tiny_tokenizer(tiny_models(variant)))
    for spec, valid in ((Spec(regex=r"[a-c]{2,4}-[0-9]{3}"), lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text)),
                        (Spec(choice=["alpha", "beta", "gamma delta"]), lambda text: text in ("alpha", "beta", "gamma delta"))):
        request_id = engine.add_request("Answer: ", SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                                                                   structured_outputs=spec))
        out = run_to_finals(engine)[request_id].outputs[0]
        assert out.finish_reason == "stop" and valid(out.text), out.text


class KeyRecorder(ContiguousContext):
    """The contiguous context (its positions only mask: 0..N-1 whatever the model rotates by), keeping each
    layer's keys (RoPE applied) as the model hands them over: a layer that keeps no keys of its own (K = V: its
    keys are derived from the values as they are read; a layer reading another's cache) keeps none here."""

    def __init__(self, positions, layer_windows, kv_sources=None, offset=0):
        super().__init__(positions, layer_windows, kv_sources)
        self.keys, self.offset = {}, offset

    def attend(self, layer, q, k, v, scale, sinks=None, keys_from_values=None):
        if k is not None:
            self.keys[layer] = k.clone()
        if keys_from_values is not None:  # derived at the positions the model rotates by, not the mask's
            derive = keys_from_values
            keys_from_values = lambda values, positions: derive(values, positions + self.offset)  # noqa: E731
        return super().attend(layer, q, k, v, scale, sinks, keys_from_values)


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_context_shift(tiny_models, variant):
    loaded = tiny_models(variant)
    model = loaded.model
    # Every layer's keys, moved by the model's own shift, equal the keys computed at the later positions (RoPE
    # is relative: what each layer sees is unchanged, within the first 16 positions where nothing else moves).
    tokens, delta = torch.randint(1, TINY_VOCAB, (8,), generator=torch.Generator().manual_seed(5)), 5
    sources = loaded.config.kv_source_layers
    early, late = (KeyRecorder(torch.arange(8), model.layer_windows, sources, offset) for offset in (0, delta))
    model(tokens, torch.arange(8), early)
    model(tokens, torch.arange(8) + delta, late)
    for layer in early.keys:  # the attention layers with keys (a hybrid model's recurrent ones keep none)
        torch.testing.assert_close(model.shift_key_positions(layer, early.keys[layer], delta), late.keys[layer],
                                   atol=1e-4, rtol=1e-4)
    # and the engine generates past its context, shifting, with its blocks accounted for at every step (a model
    # with windowed layers is refused: its windows bound what those layers hold already; a hybrid model too: its
    # recurrent state has every dropped token folded in)
    if any(model.layer_windows) or model.has_recurrent_state:
        with pytest.raises(ConfigError, match="sliding-window|recurrent state"):
            make_engine(loaded, max_model_len=24, context_overflow="shift")
        return
    engine = make_engine(loaded, max_model_len=24, context_overflow="shift", keep_tokens=4)
    request_id = engine.add_request(workload()[0][:10], greedy(40))
    assert len(run_to_finals(engine)[request_id].outputs[0].token_ids) == 40
    assert engine.scheduler.num_context_shifts >= 2


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_disk_tier_gives_the_tokens_of_a_recompute(tiny_models, tmp_path, variant):
    loaded = tiny_models(variant)
    if any(loaded.model.layer_windows) or loaded.model.has_recurrent_state:  # full-attention prefixes only
        with pytest.raises(ConfigError, match="sliding-window|recurrent-state snapshot"):
            make_engine(loaded, disk=tmp_path)
        return
    rng = np.random.default_rng(7)
    documents = [rng.integers(1, TINY_VOCAB, 24).tolist() for _ in range(3)]
    first, second = [doc + [7, 8] for doc in documents], [doc + [9] for doc in documents]
    reference = make_engine(loaded, blocks=10)  # about one document: each round evicts the ones before
    expected = run(reference, first, True, 4) + run(reference, second, True, 4)
    tiered = make_engine(loaded, blocks=10, disk=tmp_path)
    outputs = run(tiered, first, True, 4)
    tiered.tiers.flush()
    assert outputs + run(tiered, second, True, 4) == expected
    assert tiered.tiering.stats().hit_tokens > 0
