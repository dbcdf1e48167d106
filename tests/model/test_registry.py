"""The one list of supported architectures, and the errors that quote it."""

import pytest

from kvserve.errors import UnsupportedModelError
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.registry import ARCHITECTURES, GGUF, HF, find_architecture, model_class, supported_architectures


def test_lookups():
    assert supported_architectures(HF) == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                           "Gemma3ForCausalLM"]
    assert supported_architectures(GGUF) == ["llama", "qwen2", "gemma3"]
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
