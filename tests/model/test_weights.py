"""Streaming checkpoint tensors into a meta-built model: identical logits, each weight exactly once, clear errors."""

import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.errors import ModelLoadError
from kvserve.model.gguf import load_gguf
from kvserve.model.layers import Linear
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import build_model, load_model
from kvserve.model.weights import materialize, parameter_bytes
from tests.helpers import TINY_VOCAB, VARIANTS, build_hf_model, paged_logits, save_hf_model, write_gguf
from tests.model.test_layers import BFloat16Method

TOKENS = torch.randint(0, TINY_VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()


def state_dict_model(hf_model, config) -> LlamaForCausalLM:
    """The pre-streaming path: a model built on the CPU and given its whole fused state dict at once."""
    hf = hf_model.state_dict()
    state = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    # Tied: the head's weight is the embedding's tensor, listed under both names.
    state["lm_head.weight"] = state["embed_tokens.weight"] if config.tie_word_embeddings else hf["lm_head.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{ours}{norm}.weight"] = hf[f"{theirs}{norm}.weight"]
        kinds = ["weight", "bias"] if config.attention_bias else ["weight"]
        for kind in kinds:
            state[f"{ours}self_attn.qkv_proj.{kind}"] = torch.cat([hf[f"{theirs}self_attn.{x}_proj.{kind}"] for x in "qkv"])
        state[f"{ours}self_attn.o_proj.weight"] = hf[f"{theirs}self_attn.o_proj.weight"]
        state[f"{ours}mlp.gate_up_proj.weight"] = torch.cat([hf[f"{theirs}mlp.{x}_proj.weight"] for x in ("gate", "up")])
        state[f"{ours}mlp.down_proj.weight"] = hf[f"{theirs}mlp.down_proj.weight"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streamed_model_is_identical_to_the_state_dict_model(variant, tmp_path):
    hf_model = build_hf_model(variant)
    streamed = load_model(save_hf_model(hf_model, tmp_path))
    reference = state_dict_model(hf_model, streamed.config)
    assert all(not p.is_meta for p in streamed.model.parameters())
    ids = torch.tensor(TOKENS)
    assert torch.equal(streamed.model(ids, torch.arange(len(ids))), reference(ids, torch.arange(len(ids))))
    assert torch.equal(paged_logits(streamed.model, TOKENS, [7, 5]), paged_logits(reference, TOKENS, [7, 5]))


def test_gguf_is_dequantized_as_streamed_one_tensor_at_a_time(tmp_path, monkeypatch):
    import kvserve.model.gguf as gguf_module

    path = tmp_path / "tiny.gguf"
    write_gguf(build_hf_model("llama-gqa"), path, {"proj": "Q4_1", "embed": "Q8_0"})
    calls = []
    real_dequantize = gguf_module.dequantize
    monkeypatch.setattr(gguf_module, "dequantize", lambda *args: calls.append(args) or real_dequantize(*args))
    gguf_model = load_gguf(path)
    assert calls == []  # opening reads headers only

    seen: list[weakref.ref] = []

    def watched(stream):
        for name, tensor in stream:
            # The loader holds at most the tensor it was just given; every earlier one is freed.
            assert sum(ref() is not None for ref in seen[:-1]) == 0
            seen.append(weakref.ref(tensor))
            yield name, tensor

    build_model(gguf_model.config, watched(gguf_model.weights()))
    assert len(calls) == len(seen) == len(gguf_model.file.tensors)


@pytest.fixture()
def checkpoint(tmp_path):
    """A tiny Llama checkpoint directory and its single safetensors file's weights."""
    directory = save_hf_model(build_hf_model("llama-mha-tied"), tmp_path)
    (file,) = directory.glob("*.safetensors")
    return directory, file, load_file(str(file))


def test_tied_lm_head_copy_and_rotary_buffers_are_ignored(checkpoint):
    directory, file, weights = checkpoint
    baseline = load_model(directory).model(torch.tensor(TOKENS), torch.arange(len(TOKENS)))
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(weights, str(file))
    assert torch.equal(load_model(directory).model(torch.tensor(TOKENS), torch.arange(len(TOKENS))), baseline)


def test_unexpected_and_misshapen_weights_are_named(checkpoint):
    directory, file, weights = checkpoint
    save_file({**weights, "model.layers.9.mlp.gate_proj.weight": torch.zeros(2), "extra.bias": torch.zeros(1)}, str(file))
    with pytest.raises(ModelLoadError, match=r"checkpoint has 2 unexpected weights, e.g. extra.bias, model.layers.9"):
        load_model(directory)
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(weights, str(file))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(8, 64\), expected \(64, 64\)"):
        load_model(directory)


def test_every_weight_is_loaded_exactly_once(checkpoint):
    directory, file, weights = checkpoint
    config = load_model(directory).config
    names = sorted(weights)
    with pytest.raises(ModelLoadError, match="'model.norm.weight' more than once"):
        build_model(config, [(n, weights[n]) for n in names] + [("model.norm.weight", weights["model.norm.weight"])])
    missing = [n for n in names if n not in ("model.layers.2.self_attn.v_proj.weight", "model.layers.2.mlp.gate_proj.weight")]
    with pytest.raises(ModelLoadError, match=r"'model.layers.2.self_attn.v_proj.weight' is missing .* \(and 1 more\)"):
        build_model(config, [(n, weights[n]) for n in missing])


def test_weight_bytes_is_what_the_parameters_hold(embedded):
    expected = sum(p.numel() * p.element_size() for p in embedded.model.parameters())
    assert embedded.weight_bytes == {"float32": expected}
    assert f"weights held {expected / 2**20:.1f} MiB float32" in embedded.summary()


def test_a_linear_method_swapped_on_the_meta_model_is_loaded_and_counted(checkpoint):
    directory, _, weights = checkpoint
    reference = load_model(directory)
    with torch.device("meta"):
        model = LlamaForCausalLM(reference.config)
    # The tied head holds the embedding's tensor (it is converted after loading, if at all).
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    for layer in linears:  # no model code changes: the layers are re-created in another format
        layer.set_method(BFloat16Method())
    materialize(model)
    model.load_weights(weights.items())
    linear_bytes = sum(layer.weight.numel() * 2 for layer in linears)
    held = parameter_bytes(model)
    assert held["bfloat16"] == linear_bytes
    assert sum(held.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor(TOKENS)
    expected = reference.model(ids, torch.arange(len(ids)))
    ours = model.eval()(ids, torch.arange(len(ids)))
    assert not torch.equal(ours, expected) and (ours - expected).abs().max().item() < 0.05
