"""Gemma 4 against transformers: tiny random models with every feature of the text decoder on (sliding and
full layers of other head shapes, K = V, KV-sharing layers, per-layer inputs, proportional RoPE, soft-capping,
a mixture of experts beside the MLP), from an HF directory and from a GGUF twin, through the contiguous
context (the paged cache's side of the seam is tested with the cache)."""

import json

import pytest
import torch

from kvserve.errors import UnsupportedModelError
from kvserve.model.checkpoint import read_config
from kvserve.model.gemma4 import Gemma4ForCausalLM, proportional_rotary
from kvserve.model.loader import load_model
from tests.helpers import (GEMMA4_VARIANTS, TINY_VOCAB, build_hf_model, reference_greedy, reference_logits,
                           save_hf_model, write_gemma4_gguf)

SEQUENCE_LEN = 32  # well past the windows (8, 6)
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
TOLERANCE = 1e-4


def build_gemma4(variant: str):
    """build_hf_model's model, with the scales it leaves at 1 perturbed too (layer_scalar, the router's scales),
    and weights of std 0.1: at 0.02 the logits are too flat for a greedy continuation to tell much."""
    model = build_hf_model(variant)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                param.add_(torch.randn_like(param) * 0.2)
            elif param.dim() >= 2:
                param.mul_(5.0)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.add_(torch.randn_like(buffer) * 0.2)
    return model


def logits_of(model) -> torch.Tensor:
    return model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN))  # no cache: the contiguous context


def greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(num_tokens):
        sequence = ids + out
        logits = model(torch.tensor(sequence), torch.arange(len(sequence)),
                       logits_indices=torch.tensor([len(sequence) - 1]))
        out.append(int(logits[0].argmax()))
    return out


@pytest.fixture(scope="module", params=sorted(GEMMA4_VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers' model, kvserve's loaded from its saved directory) per variant."""
    hf_model = build_gemma4(request.param)
    return hf_model, load_model(save_hf_model(hf_model, tmp_path_factory.mktemp(request.param)))


def test_hf_directory_matches_transformers(pair):
    hf_model, loaded = pair
    hf = hf_model.config
    assert isinstance(loaded.model, Gemma4ForCausalLM) and loaded.config.architecture == "Gemma4ForCausalLM"
    assert loaded.model.layer_windows == tuple(hf.sliding_window if kind == "sliding_attention" else None
                                               for kind in hf.layer_types)
    scalars = hf.num_hidden_layers  # each layer's layer_scalar: a buffer in transformers, loaded here
    assert loaded.model.num_parameters() == sum(p.numel() for p in hf_model.parameters()) + scalars
    expected = reference_logits(hf_model, TOKENS)
    assert (logits_of(loaded.model) - expected).abs().max().item() <= TOLERANCE
    assert expected.std() > 0.5  # logits that tell tokens apart: the greedy test below means something


def test_config_follows_transformers(pair):
    hf_model, loaded = pair
    hf, config = hf_model.config, loaded.config
    full = [i for i, kind in enumerate(hf.layer_types) if kind == "full_attention"]
    for layer in range(hf.num_hidden_layers):
        attention = hf_model.model.layers[layer].self_attn
        assert config.kv_shape_of(layer) == (hf.num_attention_heads // attention.num_key_value_groups,
                                             attention.head_dim)
        assert config.k_eq_v_of(layer) == attention.use_alternative_attention
    sources = [i if mode != "reuse" else max(j for j in range(hf.num_hidden_layers - hf.num_kv_shared_layers)
                                             if hf.layer_types[j] == hf.layer_types[i])
               for i, mode in enumerate(hf.kv_sharing_modes)]
    assert list(config.kv_source_layers) == sources
    assert config.kv_shape_of(full[0]) != (config.num_kv_heads, config.head_dim)  # the full layers differ


def test_greedy_continuation_matches_transformers(pair):
    hf_model, loaded = pair
    expected = reference_greedy(hf_model, TOKENS[:12], 20)
    assert greedy(loaded.model, TOKENS[:12], 20) == expected
    assert len(set(expected)) > 3  # not one token repeated


def test_proportional_rope_tables_are_transformers_bits(pair):
    hf_model, loaded = pair
    rotary = hf_model.model.rotary_emb
    positions = torch.arange(SEQUENCE_LEN)
    for kind, ours in (("full_attention", loaded.model.rotary_emb), ("sliding_attention",
                                                                     loaded.model.local_rotary_emb)):
        if kind not in hf_model.config.layer_types:  # (a variant without sliding layers)
            continue
        assert torch.equal(ours.inv_freq, getattr(rotary, f"{kind}_inv_freq"))
        cos, sin = rotary(torch.zeros(1), positions[None], kind)
        assert torch.equal(ours(positions)[0], cos[0]) and torch.equal(ours(positions)[1], sin[0])


def test_features_change_the_logits(tmp_path):
    # The parity above would prove little if K = V, sharing or proportional RoPE made no difference here.
    hf_model = build_gemma4("gemma4")
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = logits_of(model)
    model.rotary_emb.inv_freq = proportional_rotary(32, 1e6, 1.0, 1.0).inv_freq  # every frequency turning
    assert (logits_of(model) - expected).abs().max() > 100 * TOLERANCE
    model.rotary_emb.inv_freq = proportional_rotary(32, 1e6, 0.25, 1.0).inv_freq
    assert (logits_of(model) - expected).abs().max() == 0
    for layer in model.layers:
        layer.per_layer_input_gate.weight.data.zero_()
    assert (logits_of(model) - expected).abs().max() > 100 * TOLERANCE


def test_shared_layers_hold_no_kv_projections(pair):
    _, loaded = pair
    for index, layer in enumerate(loaded.model.layers):
        attention = layer.self_attn
        stores = loaded.config.kv_source_of(index) == index
        assert hasattr(attention, "k_norm") == stores
        assert hasattr(attention, "q_proj") == (not stores)
        assert hasattr(attention, "qk_proj") == (stores and loaded.config.k_eq_v_of(index))


def test_conditional_generation_checkpoint_loads_its_language_model(tmp_path):
    # The Hub's checkpoints: Gemma4ForConditionalGeneration, the text decoder under model.language_model.
    import transformers

    text = build_gemma4("gemma4")
    config = transformers.Gemma4Config(text_config=text.config.to_dict(), vision_config=None, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    loaded = load_model(save_hf_model(model, tmp_path))
    assert loaded.config.architecture == "Gemma4ForConditionalGeneration"
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([TOKENS])).logits[0]
    assert (logits_of(loaded.model) - expected).abs().max().item() <= TOLERANCE


# --- config.json ---------------------------------------------------------------------------------------------

# The shape of the Hub's Gemma 4 E2B-style config.json: a Gemma4ForConditionalGeneration whose text_config gives
# global_head_dim (no per_layer_config), K = V off, the last layers sharing K/V.
HUB_STYLE_CONFIG = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
    "text_config": {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
        "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
        "global_head_dim": 512, "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
        "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "sliding_window": 512,
        "final_logit_softcapping": 30.0, "max_position_embeddings": 131072,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    },
    "vision_config": {"model_type": "gemma4_vision"}, "audio_config": None,
}


def write_config(tmp_path, **text_changes):
    config = json.loads(json.dumps(HUB_STYLE_CONFIG))
    config["text_config"].update(text_changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_hub_style_config(tmp_path):
    config = read_config(write_config(tmp_path))
    full = [i for i in range(35) if (i + 1) % 6 == 0 or i == 34]  # the default pattern, the last layer full
    assert [i for i, window in enumerate(config.layer_windows) if window is None] == full
    assert config.kv_shape_of(full[0]) == (1, 512) and config.kv_shape_of(0) == (1, 256)
    assert not any(config.layer_k_eq_v)
    assert config.kv_source_layers[15:] == tuple(11 if i in full else 14 for i in range(15, 35))  # last of its type
    assert config.mlp_width(14) == 6144 and config.mlp_width(15) == 2 * 6144
    assert (config.full_rope_fraction, config.rope_theta, config.rope_local_theta) == (0.25, 1e6, 1e4)
    assert config.tie_word_embeddings and config.per_layer_input_size == 256


@pytest.mark.parametrize("changes, message", [
    ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "'yarn'"),
])
def test_unsupported_configs_are_named(tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_config(write_config(tmp_path, **changes))


# --- GGUF ----------------------------------------------------------------------------------------------------

GGUF_MIXES = {"f32": {}, "q8_0-projections": {"self_attn.": "Q8_0", "mlp.": "Q8_0"}}


@pytest.mark.parametrize("mix", sorted(GGUF_MIXES))
@pytest.mark.parametrize("variant", sorted(GEMMA4_VARIANTS))
def test_gguf_matches_dequantized_reference(variant, mix, tmp_path):
    hf_model = build_gemma4(variant)
    path = tmp_path / "tiny.gguf"
    held = write_gemma4_gguf(hf_model, path, GGUF_MIXES[mix])
    missing, unexpected = hf_model.load_state_dict(held, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    loaded = load_model(path)
    hf_config, config = hf_model.config, loaded.config
    assert isinstance(loaded.model, Gemma4ForCausalLM) and config.architecture == "gemma4"
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    for layer, attention in enumerate(attn.self_attn for attn in hf_model.model.layers):
        assert config.k_eq_v_of(layer) == attention.use_alternative_attention
        assert config.kv_shape_of(layer)[1] == attention.head_dim
    assert (logits_of(loaded.model) - reference_logits(hf_model, TOKENS)).abs().max().item() <= TOLERANCE
