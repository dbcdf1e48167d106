"""Gemma 3 against transformers: tiny random models from an HF directory and from a GGUF, and the packaged 270M."""

import json

import numpy as np
import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.checkpoint import read_config
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.gguf import load_gguf, read_gguf_config
from kvserve.model.loader import gemma3_270m_path, load_model
from tests.helpers import (GEMMA3_VARIANTS, TINY_VOCAB, build_hf_model, paged_logits, reference_greedy,
                           reference_logits, run_to_finals, save_hf_model, write_gguf)

SEQUENCE_LEN = 32  # well past every variant's window (8, 6, 5)
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
# How the sequence is fed through the paged cache (chunks, then one token per step).
CHUNKINGS = {
    "prefill then decode": [12],
    "chunked prefill": [5, 3, 4, 7],
    "chunks straddling the window": [7, 9, 11],
    "all decode": [1],
}
TOLERANCE = 1e-4


def assert_matches(model, expected: torch.Tensor) -> None:
    for name, chunks in CHUNKINGS.items():
        diff = (paged_logits(model, TOKENS, chunks) - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
    recomputed = model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN))  # no cache: the contiguous context
    assert (recomputed - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("variant", sorted(GEMMA3_VARIANTS))
def test_hf_directory_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    hf = hf_model.config
    assert isinstance(loaded.model, Gemma3ForCausalLM) and loaded.config.architecture == "Gemma3ForCausalLM"
    assert loaded.model.layer_windows == tuple(hf.sliding_window if kind == "sliding_attention" else None
                                               for kind in hf.layer_types)
    assert {None, hf.sliding_window} == set(loaded.model.layer_windows)  # both kinds present
    assert loaded.config.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert loaded.config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert loaded.config.final_logit_softcapping == hf.final_logit_softcapping
    assert loaded.model.num_parameters() == sum(p.numel() for p in hf_model.parameters())  # tied head counted once
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))


GGUF_MIXES = {"f32": {}, "q4_1-mixed": {"proj": "Q4_1", "embed": "Q8_0"}}


@pytest.mark.parametrize("mix", sorted(GGUF_MIXES))
@pytest.mark.parametrize("variant", ["gemma3", "gemma3-mqa-scaled"])
def test_gguf_matches_dequantized_reference(variant, mix, tmp_path):
    hf_model = build_hf_model(variant)
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_gguf(hf_model, path, GGUF_MIXES[mix]), strict=False)
    loaded = load_model(path)
    assert isinstance(loaded.model, Gemma3ForCausalLM) and loaded.config.tie_word_embeddings
    # What the file leaves out comes from llama.cpp's rules: five windowed layers then one global, base 10,000.
    window = hf_model.config.sliding_window
    assert loaded.model.layer_windows == (window,) * 5 + (None,) + (window,) * 2
    assert loaded.config.rope_local_theta == 10_000.0
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))


def test_window_and_local_rope_base_change_the_logits(tmp_path):
    # The parity above would prove little if the window or the second RoPE base made no difference here.
    hf_model = build_hf_model("gemma3")
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = reference_logits(hf_model, TOKENS)
    window = hf_model.config.sliding_window
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    unwindowed = paged_logits(model, TOKENS, [12])
    assert torch.allclose(unwindowed[:window], expected[:window], atol=TOLERANCE)  # inside the window: the same
    assert (unwindowed[window:] - expected[window:]).abs().max() > 100 * TOLERANCE
    for layer in model.layers:
        layer.self_attn.sliding_window = window if layer.self_attn.local_rope else None
    model.local_rotary_emb = model.rotary_emb
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("weights_dtype", ["bfloat16", "int8", "int4"])
def test_converted_linear_weights_stay_close(weights_dtype, tmp_path):
    directory = save_hf_model(build_hf_model("gemma3"), tmp_path)
    exact = load_model(directory).model
    converted = load_model(directory, weights_dtype=weights_dtype)
    assert converted.linear_dtype == weights_dtype
    ids, positions = torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN)
    reference = exact(ids, positions)
    drift = (converted.model(ids, positions) - reference).norm() / reference.norm()
    # A tiny random model amplifies weight rounding (measured 0.012, 0.030, 0.37): the real model is below.
    assert drift < {"bfloat16": 0.03, "int8": 0.06, "int4": 0.5}[weights_dtype], f"relative logit drift {drift:.3f}"
    assert converted.model.num_parameters() == exact.num_parameters()


# --- config.json and GGUF metadata -------------------------------------------------------------------------

# The shape of google/gemma-3-270m's config.json (older keys: rope_theta, rope_local_base_freq, rope_scaling).
HUB_STYLE_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "attention_bias": False, "tie_word_embeddings": True,
}


def write_config(tmp_path, **changes):
    (tmp_path / "config.json").write_text(json.dumps({**HUB_STYLE_CONFIG, **changes}))
    return tmp_path


def test_hub_style_config(tmp_path):
    config = read_config(write_config(tmp_path))  # no layer_types: sliding_window_pattern's default, 6
    assert config.layer_windows == tuple(None if i in (5, 11, 17) else 512 for i in range(18))
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.rope_type) == (1e6, 1e4, "default")
    assert (config.query_pre_attn_scalar, config.attention_scale) == (256, 1 / 16)
    assert config.tie_word_embeddings and config.final_logit_softcapping is None
    scaled = read_config(write_config(tmp_path, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert scaled.rope_scaling.factor == 8.0 and scaled.rope_local_theta == 1e4  # the global layers' only


@pytest.mark.parametrize("changes, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ({"layer_types": ["chunked_attention"] * 18}, "chunked_attention"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal.*Gemma3ForCausalLM"),
])
def test_unsupported_configs_are_named(tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_config(write_config(tmp_path, **changes))


def write_metadata_only_gguf(path, block_count=6, sliding_window=8, extra_tensors=()) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(block_count)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_layer_norm_rms_eps(1e-6)
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    for name in ("token_embd.weight", *extra_tensors):
        writer.add_tensor(name, np.zeros((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_config_follows_llama_cpp(tmp_path):
    path = tmp_path / "windowed.gguf"
    write_metadata_only_gguf(path)
    config = read_gguf_config(path)
    assert config.layer_windows == (8, 8, 8, 8, 8, None) and config.query_pre_attn_scalar == 32  # head_dim
    write_metadata_only_gguf(path, sliding_window=0)
    assert read_gguf_config(path).layer_windows == (None,) * 6  # no window in the file: all global
    write_metadata_only_gguf(path, block_count=62)
    assert read_gguf_config(path).query_pre_attn_scalar == 64 // 4  # 27B: hidden / heads


def test_unsupported_gguf_tensor_is_named(tmp_path):
    path = tmp_path / "extra.gguf"
    write_metadata_only_gguf(path, extra_tensors=["blk.0.attn_q.bias"])
    with pytest.raises(UnsupportedModelError, match="'blk.0.attn_q.bias' is not part of a supported gemma3 model"):
        load_gguf(path)


# --- the packaged Gemma 3 270M -------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def gemma_path():
    try:
        return gemma3_270m_path()
    except ModelLoadError as exc:
        pytest.skip(f"Gemma 3 270M is not available: {exc}")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return load_model(gemma_path)


@pytest.fixture(scope="module")
def reference_model(gemma, gemma_path):
    return transformers_model(gemma.config, load_gguf(gemma_path).weights())


def transformers_model(config, weights):
    """transformers' Gemma3ForCausalLM (fp32, eager attention) holding exactly the tensors kvserve dequantized."""
    import transformers

    hf_config = transformers.Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        sliding_window=config.sliding_window, query_pre_attn_scalar=config.query_pre_attn_scalar,
        layer_types=["sliding_attention" if w else "full_attention" for w in config.layer_windows],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta},
                         "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta}},
        tie_word_embeddings=True, attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
    return model.eval()


def test_catalog_entry_matches_the_packaged_file(gemma_path):
    from kvserve.model.catalog import find_known_model

    known, actual = find_known_model("gemma-3-270m"), read_gguf_config(gemma_path)
    fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_local_theta",
              "query_pre_attn_scalar", "sliding_window", "layer_windows", "tie_word_embeddings")
    assert {f: getattr(known, f) for f in fields} == {f: getattr(actual, f) for f in fields}


@pytest.mark.slow
def test_summary_describes_the_model(gemma):
    summary = gemma.summary()
    assert "architecture gemma3: 18 layers, 4 heads / 1 KV heads (MQA) / head_dim 256" in summary
    assert "sliding window 512 on 15 of 18 layers" in summary
    assert "36,864 bytes/token" in summary and "Q4_K" in summary
    assert gemma.model.num_parameters() == 268_098_176


@pytest.mark.slow
def test_first_step_logits_match_transformers(gemma, reference_model):
    for prompt in PROMPTS:
        ids = gemma.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference_model(torch.tensor([ids])).logits[0, -1]
        ours = gemma.model(torch.tensor(ids), torch.arange(len(ids)), logits_indices=torch.tensor([len(ids) - 1]))[0]
        assert (ours - expected).abs().max().item() <= 1e-3


@pytest.mark.slow
def test_greedy_continuations_match_transformers(gemma, reference_model):
    engine = Engine(EngineConfig(kv_cache_memory="256MiB", max_num_batched_tokens=256), loaded=gemma)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # The last prompt is longer than the 512-token window, prefilled in chunks of 256.
    long_prompt = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(50))
    for prompt in [*PROMPTS, long_prompt]:
        ids = gemma.tokenizer.encode(prompt)
        request_id = engine.add_request(ids, params)
        assert run_to_finals(engine)[request_id].outputs[0].token_ids == reference_greedy(reference_model, ids, 16)
    assert len(ids) > 512
