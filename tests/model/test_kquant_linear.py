"""Layers loaded from a GGUF file's K-quant matrices hold the file's own codes and compute with them."""

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.kquant_packing import ACTIVATION_BLOCK, KQUANT_KINDS, kquant_packed_bytes
from kvserve.model import quantized_linear as ql
from kvserve.model.kquant_linear import KQuantLinearMethod
from kvserve.model.layers import Linear
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, build_hf_model, int8_activation_matmul, write_gguf
from tests.model.test_checkpoint_parity import DECODE_STEPS, PROMPT_LEN, cached_logits

pytestmark = pytest.mark.skipif(not ops.available(), reason="K-quant layers need the C++ kernels")
# llama.cpp's Q4_K_M mix: Q4_K, with V, down and the head in Q6_K (its V / down choice varies per layer).
Q4_K_M = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
          "up_proj": "Q5_K", "down_proj": "Q6_K", "embed": "Q4_K", "lm_head": "Q6_K"}
LAYERS = {"self_attn.qkv_proj": ["Q4_K", "Q4_K", "Q6_K"], "self_attn.o_proj": ["Q4_K"],
          "mlp.gate_up_proj": ["Q4_K", "Q5_K"], "mlp.down_proj": ["Q6_K"]}


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "q4_k_m.gguf"
    write_gguf(build_hf_model("llama-wide"), path, Q4_K_M)
    return path


def test_each_layer_holds_the_files_codes_exactly(q4_k_m_file):
    packed, exact = load_model(q4_k_m_file, weights_dtype="auto"), load_model(q4_k_m_file, weights_dtype="float32")
    assert packed.linear_dtype == "int4"  # every matrix a type held exactly: "auto" keeps them all
    gen = torch.Generator().manual_seed(3)
    for index in range(2):
        for name, kinds in LAYERS.items():
            layer = packed.model.layers[index].get_submodule(name)
            assert isinstance(layer.method, KQuantLinearMethod) and layer.weight is None, name
            assert [part[0] for part in layer.method.parts] == [KQUANT_KINDS[k] for k in kinds], name
            weight = exact.model.layers[index].get_submodule(name).weight  # the file's values, Q/K unpermuted
            for rows in (1, 64):
                x = torch.randn(rows, layer.input_size, generator=gen)
                expected = int8_activation_matmul(x, weight, group=ACTIVATION_BLOCK)
                assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max(), name
    head = packed.model.lm_head
    assert [part[0] for part in head.method.parts] == [KQUANT_KINDS["Q6_K"]]
    x = torch.randn(3, 256, generator=gen)
    expected = int8_activation_matmul(x, exact.model.lm_head.weight, group=ACTIVATION_BLOCK)
    assert (head(x).double() - expected).abs().max() < 1e-5 * expected.abs().max()
    # About the file's bytes: no int8 copy, no fp32 copy of a K-quant matrix.
    qkv = packed.model.layers[0].self_attn.qkv_proj
    assert sum(p.numel() for p in qkv.parameters()) == (kquant_packed_bytes(256, 256, "Q4_K")  # Q
                                                        + kquant_packed_bytes(128, 256, "Q4_K")  # K
                                                        + kquant_packed_bytes(128, 256, "Q6_K"))  # V


def test_loading_dequantizes_no_k_quant_layer_matrix(q4_k_m_file, monkeypatch):
    # The layers' K-quant matrices come to the model as shapes only: nothing dequantized, nothing written
    # into their fp32 parameters; only the embedding (a lookup table) and the untied head are decoded.
    from kvserve.model import gguf as gguf_module

    decoded = []
    real = gguf_module.dequantize
    monkeypatch.setattr(gguf_module, "dequantize",
                        lambda raw, type_name, shape: decoded.append(shape) or real(raw, type_name, shape))
    loaded = load_model(q4_k_m_file, weights_dtype="auto")
    assert loaded.linear_dtype == "int4"
    assert [shape for shape in decoded if len(shape) == 2] == [(TINY_VOCAB, 256)] * 2


def _logit_error(path, dtype: str) -> float:
    token_ids = torch.randint(0, TINY_VOCAB, (PROMPT_LEN + DECODE_STEPS,),
                              generator=torch.Generator().manual_seed(2)).tolist()
    exact = cached_logits(load_model(path, weights_dtype="float32").model, token_ids)
    held = cached_logits(load_model(path, weights_dtype=dtype).model, token_ids)
    return float((held - exact).abs().max() / exact.abs().max())


def test_a_q4_k_m_file_gives_its_dequantized_logits_within_the_q4_0_paths_tolerance(q4_k_m_file, tmp_path):
    # The only rounding beyond the file's weights is the int8 activations, as on a Q4_0 file held as its
    # own 4-bit groups: the same model written in Q4_0 sets the bar.
    q4_0 = tmp_path / "q4_0.gguf"
    write_gguf(build_hf_model("llama-wide"), q4_0, {"proj": "Q4_0", "embed": "Q8_0", "lm_head": "Q8_0"})
    q4_0_error, k_error = _logit_error(q4_0, "int4"), _logit_error(q4_k_m_file, "int4")
    print(f"relative logit error: Q4_K_M {k_error:.2e}, Q4_0 {q4_0_error:.2e}")
    assert 0 < k_error <= max(2 * q4_0_error, 0.01), (k_error, q4_0_error)


def test_a_projection_mixing_k_quants_with_group_types_holds_groups_of_the_files_values(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_gguf(build_hf_model("llama-wide"), path, {"q_proj": "Q4_K", "k_proj": "Q8_0", "v_proj": "Q8_0",
                                                    "o_proj": "Q6_K", "mlp": "Q8_0"})
    loaded, exact = load_model(path, weights_dtype="int8"), load_model(path, weights_dtype="float32")
    layer = loaded.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.method, ql.GroupQuantizedLinearMethod)
    assert isinstance(layer.self_attn.o_proj.method, KQuantLinearMethod)
    assert isinstance(layer.mlp.down_proj.method, ql.GroupQuantizedLinearMethod)
    # The Q4_K shard was never loaded as fp32 (its rows are the file's values re-quantized to 8 bits), the
    # Q8_0 shards are the file's own codes.
    x = torch.randn(4, 256)
    expected = exact.model.layers[0].self_attn.qkv_proj(x)
    assert (layer.self_attn.qkv_proj(x) - expected).norm() / expected.norm() < 0.02


def test_parts_that_do_not_make_the_layer_are_refused():
    from tests.kernels.test_kquant_matmul import random_kquant

    layer = Linear(256, 48)
    with pytest.raises(ValueError, match="do not make a layer of 48 outputs"):
        KQuantLinearMethod().process_weights_after_loading(layer, [random_kquant("Q4_K", 32, 256, 1)])
    with pytest.raises(ValueError, match="of 512 inputs in a layer of 256"):
        KQuantLinearMethod().process_weights_after_loading(layer, [random_kquant("Q4_K", 48, 512, 1)])


def test_a_moe_files_k_quant_experts_are_held_from_their_codes(tmp_path):
    """Experts in K-quants (a Qwen3-MoE Q4_K_M file's) stream as shapes only, never as fp32 (a 30B MoE's
    would not fit in memory), and each expert's layers hold the file's super-blocks exactly."""
    import transformers

    from kvserve.model.gguf import load_gguf
    from tests.helpers import TINY_VOCAB, int8_activation_matmul

    config = transformers.Qwen3MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        norm_topk_prob=True, max_position_embeddings=256)
    torch.manual_seed(0)
    path = tmp_path / "moe.gguf"
    write_gguf(transformers.Qwen3MoeForCausalLM(config).eval(), path,
               {"down_proj": "Q6_K", "experts": "Q4_K", "q_proj": "Q8_0"})
    streamed = dict(load_gguf(path).weights(codes_held=True))
    experts = [name for name in streamed if ".experts." in name]
    assert experts and all(streamed[name].is_meta for name in experts)
    packed, exact = load_model(path, weights_dtype="int8"), load_model(path, weights_dtype="float32")
    gen = torch.Generator().manual_seed(1)
    for index in range(2):
        for expert in range(4):
            for name, kinds in (("gate_up_proj", ["Q4_K", "Q4_K"]), ("down_proj", ["Q6_K"])):
                layer = packed.model.layers[index].mlp.experts[expert].get_submodule(name)
                assert isinstance(layer.method, KQuantLinearMethod), name
                assert [part[0] for part in layer.method.parts] == [KQUANT_KINDS[k] for k in kinds], name
                weight = exact.model.layers[index].mlp.experts[expert].get_submodule(name).weight
                x = torch.randn(2, layer.input_size, generator=gen)
                expected = int8_activation_matmul(x, weight, group=ACTIVATION_BLOCK)
                assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max(), name
