"""LFM2 against transformers: tiny random hybrids (short convolutions and attention) from an HF directory and
from a GGUF twin; its config readers; the convolution's state carried across pieces."""

import json

import gguf
import numpy as np
import pytest
import torch
import transformers

from kvserve.config import ATTENTION, RECURRENT
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.context import ContiguousStateContext
from kvserve.kv.state.state_spec import state_spec
from kvserve.model.checkpoint import read_config
from kvserve.model.gguf import load_gguf, read_gguf_config
from kvserve.model.lfm2 import Lfm2ForCausalLM, mlp_width, read_gguf_config as lfm2_gguf_config, read_hf_config
from kvserve.model.loader import build_model, load_model
from tests.helpers import (HYBRID_VARIANTS, TINY_VOCAB, build_hf_model, paged_logits, reference_greedy,
                           reference_logits, save_hf_model)
from tests.lfm2_gguf import write_lfm2_gguf

LFM2_VARIANTS = sorted(name for name in HYBRID_VARIANTS if name.startswith("lfm2"))
SEQUENCE_LEN = 32
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
CHUNKINGS = {"prefill then decode": [12], "chunked prefill": [5, 3, 4, 7], "all decode": [1]}
TOLERANCE = 1e-4


def assert_matches(model, expected: torch.Tensor) -> None:
    for name, chunks in CHUNKINGS.items():  # the attention layers paged, the convolutions' windows in slots
        diff = (paged_logits(model, TOKENS, chunks) - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
    recomputed = model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN))  # no cache: the contiguous contexts
    assert (recomputed - expected).abs().max().item() <= TOLERANCE


def greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """kvserve's greedy continuation, recomputing the whole sequence each step (no cache)."""
    out = list(ids)
    for _ in range(num_tokens):
        logits = model(torch.tensor(out), torch.arange(len(out)), logits_indices=torch.tensor([len(out) - 1]))
        out.append(int(logits[0].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("variant", LFM2_VARIANTS)
def test_hf_directory_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    hf = hf_model.config
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    config = loaded.config
    assert isinstance(loaded.model, Lfm2ForCausalLM) and config.architecture == "Lfm2ForCausalLM"
    assert config.layer_kinds == tuple(RECURRENT if kind == "conv" else ATTENTION for kind in hf.layer_types)
    assert config.recurrent_state == ((hf.hidden_size, hf.conv_L_cache - 1),)
    assert config.intermediate_size == hf_model.model.layers[0].feed_forward.w1.out_features
    assert (config.conv_bias, config.tie_word_embeddings) == (hf.conv_bias, hf.tie_word_embeddings)
    assert loaded.model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    expected = reference_greedy(hf_model, TOKENS[:8], 20)
    assert len(set(expected)) > 3  # a continuation that would tell a wrong model apart
    assert greedy(loaded.model, TOKENS[:8], 20) == expected


def test_operators_change_the_logits(tmp_path):
    # The parity above would prove little if the final norm, the convolution's older taps (what the window
    # carries between pieces) or the q/k norms made no difference here.
    hf_model = build_hf_model("lfm2")
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = reference_logits(hf_model, TOKENS)
    for parameter, value in ((model.embedding_norm.weight, 1.0), (model.layers[0].conv.conv.weight[:, :-1], 0.0),
                             (model.layers[1].self_attn.q_norm.weight, 1.0)):
        saved = parameter.clone()
        parameter.fill_(value)
        assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
        parameter.copy_(saved)


# --- GGUF ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [{}, {"proj": "Q8_0", "embed": "Q8_0", "feed_forward": "F16"}])
def test_gguf_matches_dequantized_reference(mix, tmp_path):
    hf_model = build_hf_model("lfm2")
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_lfm2_gguf(hf_model, path, mix), strict=False)
    loaded = load_model(path)
    hf = hf_model.config
    assert isinstance(loaded.model, Lfm2ForCausalLM) and loaded.config.architecture == "lfm2"
    from_json = read_config(save_hf_model(hf_model, tmp_path / "hf"))
    for field in ("layer_kinds", "recurrent_state", "intermediate_size", "num_kv_heads", "head_dim",
                  "tie_word_embeddings", "rope_theta"):
        assert getattr(loaded.config, field) == getattr(from_json, field), field
    assert loaded.config.rms_norm_eps == pytest.approx(from_json.rms_norm_eps)  # a float32 in the file
    assert loaded.config.num_kv_heads == hf.num_key_value_heads
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    assert greedy(loaded.model, TOKENS[:8], 20) == reference_greedy(hf_model, TOKENS[:8], 20)


def test_a_quantized_files_linear_types_leave_out_the_convolution_kernels(tmp_path):
    # The kernels stay F32 in a Q4_0 file (as llama.cpp keeps them); they are no linear layer's matrix, so they
    # must not make the file's matrices look like some other type ("auto" weights: int4 for a Q4_0 file).
    path = tmp_path / "tiny.gguf"
    write_lfm2_gguf(build_hf_model("lfm2"), path, {"proj": "Q4_0", "feed_forward": "Q4_0"})
    assert load_gguf(path).linear_types == {"Q4_0"}


def gguf_meta(**changes) -> dict:
    meta = {"lfm2.embedding_length": 64, "lfm2.block_count": 4, "lfm2.feed_forward_length": 96,
            "lfm2.attention.head_count": 4, "lfm2.attention.head_count_kv": [0, 2, 0, 2],
            "lfm2.context_length": 256, "lfm2.attention.layer_norm_rms_epsilon": 1e-5, "lfm2.shortconv.l_cache": 3}
    return {**meta, **changes}


def test_gguf_layer_kinds_come_from_the_per_layer_kv_heads():
    config = lfm2_gguf_config(gguf_meta(), "lfm2", TINY_VOCAB)
    assert config.layer_kinds == (RECURRENT, ATTENTION, RECURRENT, ATTENTION) and config.num_kv_heads == 2
    assert config.recurrent_state == ((64, 2),) and config.intermediate_size == 96  # the width as written


@pytest.mark.parametrize("changes, error, message", [
    ({"lfm2.shortconv.l_cache": None}, ModelLoadError, "shortconv.l_cache"),
    ({"lfm2.shortconv.l_cache": 1}, UnsupportedModelError, "kernel of 1"),
    ({"lfm2.attention.head_count_kv": [0, 2, 0, 4]}, UnsupportedModelError, "different KV head counts"),
    ({"lfm2.attention.head_count_kv": [0, 2, 0]}, ModelLoadError, "3 entries for 4 layers"),
    ({"lfm2.attention.sliding_window": 512}, UnsupportedModelError, "sliding-window"),
])
def test_bad_gguf_metadata_is_named(changes, error, message):
    meta = {key: value for key, value in gguf_meta(**changes).items() if value is not None}
    with pytest.raises(error, match=message):
        lfm2_gguf_config(meta, "lfm2", TINY_VOCAB)


def test_gguf_with_convolution_biases_is_refused(tmp_path):
    # llama.cpp's lfm2 has no convolution biases: a file holding some is refused by name, not half-loaded.
    path = tmp_path / "tiny.gguf"
    write_lfm2_gguf(build_hf_model("lfm2"), path, {})
    assert read_gguf_config(path).layer_kinds is not None
    writer = gguf.GGUFWriter(str(tmp_path / "biased.gguf"), "lfm2")
    for key, value in gguf_meta().items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((TINY_VOCAB, 64), np.float32))
    writer.add_tensor("blk.0.shortconv.in_proj.bias", np.zeros(192, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="shortconv.in_proj.bias"):
        load_gguf(tmp_path / "biased.gguf")


# --- config.json ---------------------------------------------------------------------------------------

WIDTH_CASES = [
    dict(block_ff_dim=6656),  # LFM2-350M: 2/3, rounded up to 256 -> 4608 (llama.cpp's 350M n_ff)
    dict(intermediate_size=12288),  # LFM2-1.2B -> 8192
    dict(intermediate_size=10752, block_auto_adjust_ff_dim=False),  # LFM2-2.6B: as given
    dict(intermediate_size=1000, block_ffn_dim_multiplier=1.3, block_multiple_of=64),
    dict(intermediate_size=1000, block_ffn_dim_multiplier=None),  # no multiplier: no rounding either
]


@pytest.mark.parametrize("fields", WIDTH_CASES)
def test_mlp_width_is_transformers(fields):
    config = transformers.Lfm2Config(hidden_size=64, num_attention_heads=4,
                                     **{k: v for k, v in fields.items() if v is not None})
    config.__dict__.update(fields)  # None: what transformers' MLP code allows and its config now refuses
    with torch.device("meta"):
        expected = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(config).w1.out_features
    assert mlp_width(fields) == expected
    assert mlp_width({"block_ff_dim": 6656}) == 4608 and mlp_width({"intermediate_size": 12288}) == 8192


def lfm2_350m_json() -> dict:
    """LFM2-350M's published config.json, the fields its shape reads."""
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 1024,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
            "max_position_embeddings": 128000, "norm_eps": 1e-05, "conv_bias": False, "conv_L_cache": 3,
            "rope_theta": 1000000.0, "block_ff_dim": 6656, "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "tie_embedding": True,
            "full_attn_idxs": [2, 5, 8, 10, 12, 14]}


def test_lfm2_350m_shape_and_state_bytes():
    config = read_hf_config(lfm2_350m_json(), "Lfm2ForCausalLM")
    assert config.attention_layers == (2, 5, 8, 10, 12, 14) and len(config.recurrent_layers) == 10
    assert (config.head_dim, config.intermediate_size, config.tie_word_embeddings) == (64, 4608, True)
    spec = state_spec(config)
    assert spec.slot_bytes == 10 * 1024 * 2 * 4  # ten windows of two float32 inputs per channel
    assert kv_spec(config, "float16").num_layers == 6  # only the attention layers keep K/V


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ["conv", "sliding_attention"] * 8}, "sliding_attention"),
    ({"layer_types": ["conv", "full_attention"]}, "2 entries for 16 layers"),
    ({"conv_L_cache": 1}, "kernel of 1"),
])
def test_unsupported_configs_are_named(changes, message):
    with pytest.raises((UnsupportedModelError, ModelLoadError), match=message):
        read_hf_config({**lfm2_350m_json(), **changes}, "Lfm2ForCausalLM")


def test_config_json_defaults(tmp_path):
    # Without layer_types or full_attn_idxs every layer attends; tie_embedding overrides tie_word_embeddings.
    cfg = {key: value for key, value in lfm2_350m_json().items() if key != "full_attn_idxs"}
    config = read_hf_config({**cfg, "tie_embedding": False, "tie_word_embeddings": True}, "Lfm2ForCausalLM")
    assert config.recurrent_layers == () and config.tie_word_embeddings is False
    (tmp_path / "config.json").write_text(json.dumps(lfm2_350m_json()))
    assert read_config(tmp_path).layer_kinds.count(RECURRENT) == 10


# --- the convolution's state ---------------------------------------------------------------------------


def test_segment_convolution_equals_the_update_step():
    # One convolution over a segment and the one-row update step, row after row, give the same outputs
    # and window (the bias included), to the bit: a token's output does not depend on how it was chunked.
    model = load_model_in_process("lfm2-bias")
    conv = next(layer.conv.conv for layer in model.layers if not layer.attends)
    rows = torch.randn(11, conv.weight.shape[0], generator=torch.Generator().manual_seed(1))
    whole, whole_state = conv.run(rows, None)
    state, outputs = None, []
    for row in rows:
        out, state = conv.run(row[None], state)
        outputs.append(out)
    assert torch.equal(torch.cat(outputs), whole)
    assert torch.equal(state[0], whole_state[0]) and torch.equal(whole_state[0], rows[-3:].t())


def load_model_in_process(variant: str) -> Lfm2ForCausalLM:
    """A variant's model from transformers' state dict, without a checkpoint directory."""
    hf_model = build_hf_model(variant)
    config = read_hf_config({**hf_model.config.to_dict(), "architectures": ["Lfm2ForCausalLM"]}, "Lfm2ForCausalLM")
    return build_model(config, hf_model.state_dict().items())


def test_contiguous_forward_keeps_nothing():
    model = load_model_in_process("lfm2")
    states = ContiguousStateContext(SEQUENCE_LEN)
    ids, positions = torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN)
    assert torch.equal(model(ids, positions, states=states), model(ids, positions))
