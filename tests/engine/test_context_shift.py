"""Drop-oldest context shift (--context-overflow shift): generation goes on past the model's context."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from tests.helpers import TINY_VOCAB, run_to_finals

BS = 4
CONTEXT = 24
KEEP = 4


def shift_config(**overrides):
    config = dict(block_size=BS, kv_cache_memory="1MiB", max_model_len=CONTEXT, context_overflow="shift",
                  keep_tokens=KEEP)
    config.update(overrides)
    return EngineConfig(**config)


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def prompt(length, seed=0):
    return torch.randint(0, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def shifted_recompute(model, tokens, max_tokens, context=CONTEXT, keep=KEEP):
    """The reference: the same shifts on the token list, each next token from a full forward over it."""
    context_ids, outputs = list(tokens), []
    for _ in range(max_tokens):
        logits = model(torch.tensor(context_ids), torch.arange(len(context_ids)))
        outputs.append(int(logits[-1].argmax()))
        context_ids.append(outputs[-1])
        if len(context_ids) > context:
            drop = (len(context_ids) - 1 - keep) // 2
            del context_ids[keep : keep + drop]
    return outputs


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_a_one_layer_model_continues_exactly_like_a_recompute_of_the_shifted_context(tiny_models, kv_dtype):
    # One layer: cached K/V depend on token and position only, so re-rotated keys must equal recomputed ones.
    loaded = tiny_models("llama-1-layer")
    engine = Engine(shift_config(kv_cache_dtype=kv_dtype), loaded=loaded)
    request_id = engine.add_request(prompt(10), greedy(60))
    finals = run_to_finals(engine)
    assert engine.scheduler.num_context_shifts >= 5
    expected = shifted_recompute(loaded.model, prompt(10), 60)
    assert list(finals[request_id].outputs[0].token_ids) == expected


def test_the_shifted_keys_equal_recomputed_keys(tiny_models):
    loaded = tiny_models("llama-1-layer")
    engine = Engine(shift_config(), loaded=loaded)
    engine.add_request(prompt(10), greedy(20))  # the 15th output would be position 24: one shift, mid-generation
    while engine.scheduler.num_context_shifts == 0:
        engine.step()
    request = engine.scheduler.running[0]
    context = request.all_token_ids[: request.num_computed_tokens]
    slots = engine.attention_backend.token_slots(
        engine.kv_cache, torch.tensor([engine.kv_manager.block_ids(request.request_id)[0][p // BS]
                                       for p in range(len(context))]),
        torch.tensor([p % BS for p in range(len(context))]))
    cached_k, cached_v = engine.kv_cache.read_rows(0, slots)
    attn = loaded.model.layers[0].self_attn
    x = loaded.model.layers[0].input_layernorm(loaded.model.embed_tokens(torch.tensor(context)))
    q, k, v = attn.qkv_proj(x).split([attn.num_heads * attn.head_dim] + [attn.num_kv_heads * attn.head_dim] * 2, -1)
    cos, sin = loaded.model.rotary_emb(torch.arange(len(context)))
    from kvserve.kernels.ops import apply_rope

    fresh_k = apply_rope(k.view(len(context), attn.num_kv_heads, attn.head_dim), cos, sin)
    torch.testing.assert_close(cached_k, fresh_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached_v, v.view_as(cached_v), atol=1e-6, rtol=1e-6)


def test_shifts_with_shared_blocks_prefix_caching_and_preemption_keep_the_pool_sound(tiny_models):
    loaded = tiny_models("llama-gqa")
    # Two requests share their prompt's blocks (the shift must copy those, not rewrite them); a tight pool
    # preempts; check_integrity() runs after every step.
    engine = Engine(shift_config(kv_cache_memory=None, max_num_seqs=4), loaded=loaded)
    page = engine.kv_spec.page_bytes(BS)
    engine = Engine(shift_config(kv_cache_memory=14 * page), loaded=loaded)
    shared = prompt(13, seed=1)
    ids = [engine.add_request(shared, greedy(40)), engine.add_request(shared, greedy(40)),
           engine.add_request(prompt(9, seed=2), greedy(50))]
    finals = run_to_finals(engine)
    assert all(len(finals[i].outputs[0].token_ids) == n for i, n in zip(ids, (40, 40, 50)))
    assert engine.scheduler.num_context_shifts >= 6
    assert finals[ids[0]].outputs[0].token_ids == finals[ids[1]].outputs[0].token_ids  # greedy, same context
    # A fresh request with the same prompt still hits the prompt's blocks: shifts never rewrote cached blocks.
    engine.add_request(shared, greedy(1))
    run_to_finals(engine)
    assert engine.stats().prefix_cache_hits >= 12


def test_without_shift_a_request_past_the_context_is_refused(tiny_models):
    loaded = tiny_models("llama-gqa")
    engine = Engine(EngineConfig(block_size=BS, kv_cache_memory="1MiB", max_model_len=CONTEXT), loaded=loaded)
    with pytest.raises(InvalidRequestError, match="exceeds the model's context of 24"):
        engine.add_request(prompt(10), greedy(20))
    shifting = Engine(shift_config(), loaded=loaded)
    shifting.add_request(prompt(10), greedy(20))  # accepted: generation goes past the context
    with pytest.raises(InvalidRequestError, match="the prompt \\(25 tokens\\) exceeds"):
        shifting.add_request(prompt(25), greedy(1))


def test_shift_config_is_checked(tiny_models):
    with pytest.raises(ConfigError, match="context_overflow must be one of"):
        EngineConfig(context_overflow="truncate")
    with pytest.raises(ConfigError, match="keep_tokens .* at most half"):
        Engine(shift_config(keep_tokens=13), loaded=tiny_models("llama-gqa"))
    with pytest.raises(ConfigError, match="sliding-window layers"):
        Engine(shift_config(), loaded=tiny_models("mistral-window"))
