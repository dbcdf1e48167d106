"""The one list of supported architectures, and the errors that quote it."""

import pytest

from kvserve.errors import UnsupportedModelError
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.registry import ARCHITECTURES, GGUF, HF, find_architecture, model_class, supported_architectures


def test_lookups():
    assert supported_architectures(HF) == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                           "Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                           "SmolLM3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM",
                                           "GraniteForCausalLM", "GraniteMoeHybridForCausalLM",
                                           "Ministral3ForCausalLM", "GptOssForCausalLM",
                                           "Lfm2ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                           "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                           "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"]
    assert supported_architectures(GGUF) == ["llama", "qwen2", "gemma3", "qwen3", "qwen3moe", "smollm3", "phi3",
                                             "olmo2", "granite", "mistral3", "gpt-oss",
                                             "lfm2", "qwen35", "qwen35moe", "gemma4"]
    # llama.cpp's converter permutes Q/K for the architectures it converts as a Llama (ggml's interleaved RoPE)
    assert [name for name in supported_architectures(GGUF) if find_architecture(name, GGUF).gguf_permuted_qk] == [
        "llama", "smollm3", "granite", "mistral3"]
    assert find_architecture("llama", GGUF).gguf_permuted_qk
    assert not find_architecture("qwen2", GGUF).gguf_permuted_qk
    assert not find_architecture("gemma3", GGUF).gguf_permuted_qk
    assert find_architecture("gemma3", GGUF).gguf_norm_shift == 1.0
    assert find_architecture("llama", GGUF).gguf_norm_shift == 0.0
    assert model_class("MistralForCausalLM") is LlamaForCausalLM
    assert model_class("gemma3") is model_class("Gemma3ForCausalLM") is Gemma3ForCausalLM
    assert len({arch.name for arch in ARCHITECTURES}) == len(ARCHITECTURES)  # model_class looks up by name alone


def test_unsupported_architectures_list_what_is_supported():
    with pytest.raises(UnsupportedModelError, match="architecture 'GPT2LMHeadModel' is not supported; "
                                                    "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                                    "Gemma3ForCausalLM"):
        find_architecture("GPT2LMHeadModel", HF)
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'falcon' is not supported; supported: llama, qwen2, gemma3"):
        find_architecture("falcon", GGUF)
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported"):
        find_architecture("llama", HF)  # names are per source
    with pytest.raises(UnsupportedModelError, match="'gemma2' is not supported"):
        model_class("gemma2")


def test_each_architecture_belongs_to_a_listed_family():
    from kvserve.model.registry import FAMILIES

    assert {arch.family for arch in ARCHITECTURES} == set(FAMILIES)
    assert find_architecture("Qwen2ForCausalLM", HF).family is find_architecture("llama", GGUF).family
    with pytest.raises(UnsupportedModelError, match="multimodal Gemma 3 checkpoints"):
        find_architecture("Gemma3ForConditionalGeneration", HF)  # recognized by its family, refused with a reason


def test_a_new_family_plugs_in_through_the_registry_alone(monkeypatch, tmp_path):
    # What adding a family takes: its ModelFamily and architectures in the registry's list; the readers and
    # the loader find it there (here a Llama-shaped family whose config.json says "TinyForCausalLM").
    import json

    from kvserve.model import registry
    from kvserve.model.checkpoint import read_config
    from kvserve.model.family import Architecture, ModelFamily, gguf_config
    from kvserve.model.llama import FAMILY as LLAMA, read_hf_config

    seen = []

    def read_tiny(cfg, arch):
        seen.append(arch)
        return read_hf_config(cfg, arch)

    tiny = ModelFamily(LlamaForCausalLM, read_tiny, gguf_config, LLAMA.gguf_layer_tensors)
    monkeypatch.setattr(registry, "ARCHITECTURES", (*ARCHITECTURES, Architecture("TinyForCausalLM", HF, tiny)))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["TinyForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    config = read_config(tmp_path)
    assert seen == ["TinyForCausalLM"] and config.architecture == "TinyForCausalLM" and config.num_layers == 2
    assert model_class("TinyForCausalLM") is LlamaForCausalLM
    assert "TinyForCausalLM" in supported_architectures(HF)
