"""kvserve against transformers on tiny random models of every supported family and variant."""

import json
import logging

import pytest
import torch

from kvserve.errors import ModelLoadError, TokenizerUnavailableError, UnsupportedModelError
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, VARIANTS, build_hf_model, paged_logits, reference_logits, save_hf_model

PROMPT_LEN = 12
DECODE_STEPS = 20


def cached_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits from one prefill of the prompt, then one cached decode step per remaining token."""
    return paged_logits(model, token_ids, [PROMPT_LEN])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_and_cached_decode_match_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    assert loaded.config.architecture == hf_model.config.architectures[0]
    token_ids = torch.randint(0, TINY_VOCAB, (PROMPT_LEN + DECODE_STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = reference_logits(hf_model, token_ids)
    ours = cached_logits(loaded.model, token_ids)
    assert (ours - expected).abs().max().item() <= 1e-4
    # chunked prefill through the cache, and the recompute path (no cache), agree too
    chunked = paged_logits(loaded.model, token_ids, [5, 3, 4, 7])
    assert (chunked - expected).abs().max().item() <= 1e-4
    recomputed = loaded.model(torch.tensor(token_ids), torch.arange(len(token_ids)))
    assert (recomputed - expected).abs().max().item() <= 1e-4


def test_sliding_window_is_applied(tmp_path):
    # A window shorter than the sequence must change the logits (else the parity test above proves nothing about it).
    hf_model = build_hf_model("mistral-window")
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    assert loaded.config.sliding_window == 8
    token_ids = list(range(3, 3 + PROMPT_LEN + DECODE_STEPS))
    windowed = cached_logits(loaded.model, token_ids)
    object.__setattr__(loaded.config, "sliding_window", None)
    for layer in loaded.model.layers:
        layer.self_attn.sliding_window = None
    full = cached_logits(loaded.model, token_ids)
    assert torch.allclose(windowed[:8], full[:8], atol=1e-5)
    assert not torch.allclose(windowed[-1], full[-1], atol=1e-3)


def test_directory_without_tokenizer_loads_for_token_ids(tmp_path, caplog):
    loaded_dir = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    with caplog.at_level(logging.WARNING):
        loaded = load_model(loaded_dir)
    assert loaded.tokenizer is None
    assert "token-id input and output only" in caplog.text
    with pytest.raises(TokenizerUnavailableError, match="send token ids"):
        loaded.require_tokenizer()


def test_unsupported_architecture_is_named(tmp_path):
    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel' is not supported"):
        load_model(directory)


def test_unsupported_rope_scaling_is_named(tmp_path):
    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        load_model(directory)


def test_missing_files_get_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path / "m")
    for file in directory.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(directory)


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    (file,) = directory.glob("*.safetensors")
    weights = load_file(str(file))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(file))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(directory)
