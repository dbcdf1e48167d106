import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.errors import ConfigError
from kvserve.kernels import ops
from kvserve.model import quantized_linear as ql
from kvserve.model.layers import Linear
from kvserve.model.loader import load_model
from tests.helpers import build_hf_model, save_hf_model

needs_kernels = pytest.mark.skipif(ops.kernels() is None, reason="int8/int4 weights need the C++ kernels")


def _linear(rows: int, cols: int, bias: bool = False, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(cols, rows, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


@needs_kernels
@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_group_quantized_layers_multiply_by_the_codes_they_hold(dtype, rows):
    layer, reference = _linear(160, 64, bias=True), _linear(160, 64, bias=True)
    layer.method = ql._method(dtype)
    codes = ql.quantize_groups(layer.weight.detach(), ql.GROUP_BITS[dtype])
    layer.method.process_weights_after_loading(layer)
    assert layer.weight is None and layer.packed.dtype == torch.uint8  # nothing but the packed codes
    x = torch.randn(rows, 64)
    out = layer(x)
    assert out.shape == (rows, 160) and out.dtype == torch.float32
    expected = x @ codes.dequantize().T + layer.bias
    # int8 activations (per group of 32) are the only rounding beyond the held weight's
    assert (out - expected).norm() / expected.norm() < 0.02
    error = (out - reference(x)).norm() / reference(x).norm()
    assert error < {"int8": 0.02, "int4": 0.15}[dtype]


@needs_kernels
def test_a_checkpoints_own_codes_are_held_as_they_are():
    layer = _linear(32, 64)
    source = ql.quantize_groups(torch.randn(32, 64), 4)
    layer.method = ql._method("int8")  # 4-bit codes fit an 8-bit layer exactly
    layer.method.process_weights_after_loading(layer, source)
    x = torch.randn(2, 64)
    expected = x @ source.dequantize().T
    assert (layer(x) - expected).norm() / expected.norm() < 0.02


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bf16_layers(dtype):
    layer, reference = _linear(160, 64), _linear(160, 64)
    layer.method = ql._method(dtype)
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(5, 64)
    assert (layer(x) - reference(x)).norm() / reference(x).norm() < 0.01


@needs_kernels
def test_converting_a_model_keeps_the_parameter_count_and_holds_fewer_bytes(tmp_path):
    directory = save_hf_model(build_hf_model("llama-mha-tied"), tmp_path)
    exact = load_model(directory)
    int4 = load_model(directory, weights_dtype="int4")
    assert int4.linear_dtype == "int4"
    assert int4.model.num_parameters() == exact.model.num_parameters()
    assert sum(int4.weight_bytes.values()) < sum(exact.weight_bytes.values())
    assert set(int4.weight_bytes) == {"float32", "uint8"}  # fp32 embedding and norms, packed codes
    head = int4.model.lm_head
    assert isinstance(head.method, ql.GroupQuantizedLinearMethod) and head.method.bits == 8  # an 8-bit head
    # The tied embedding stays fp32 for lookups; the head holds its own codes.
    assert int4.model.embed_tokens.weight.dtype == torch.float32
    assert exact.model.lm_head.weight is exact.model.embed_tokens.weight
    ids = torch.arange(1, 20)
    a, b = exact.model(ids, torch.arange(19)), int4.model(ids, torch.arange(19))
    assert (b - a).norm() / a.norm() < 0.2


@needs_kernels
@pytest.mark.parametrize("file_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_gguf_files_own_codes_are_what_the_layers_hold(file_type, tmp_path, monkeypatch):
    from kvserve.model import gguf as gguf_module
    from tests.helpers import int8_activation_matmul, write_gguf

    path = tmp_path / "model.gguf"
    write_gguf(build_hf_model("llama-gqa"), path, {"proj": file_type})
    dtype = "int4" if file_type.startswith("Q4") else "int8"
    decoded = []  # the types dequantized to fp32 while loading: none of the layers' matrices' (held as codes)
    real = gguf_module.dequantize
    monkeypatch.setattr(gguf_module, "dequantize",
                        lambda raw, type_name, shape: decoded.append(type_name) or real(raw, type_name, shape))
    packed = load_model(path, weights_dtype=dtype)
    assert decoded and file_type not in decoded
    exact = load_model(path, weights_dtype="float32")
    assert file_type in decoded  # float32 layers are the dequantized file
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer = packed.model.layers[1].get_submodule(name)
        weight = exact.model.layers[1].get_submodule(name).weight  # the file's values (Q, K rows unpermuted)
        x = torch.randn(3, layer.input_size)
        expected = int8_activation_matmul(x, weight)
        # The file's weights exactly: re-quantized ones (Q4_0's symmetric blocks as min/max groups) would
        # be off by ~1e-3, far beyond fp32 rounding.
        assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max(), name


def test_float32_is_the_model_as_loaded(tmp_path):
    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    loaded = load_model(directory, weights_dtype="float32")
    assert loaded.linear_dtype == "float32" and set(loaded.weight_bytes) == {"float32"}


def test_auto_picks_by_the_cpu(monkeypatch):
    monkeypatch.setattr(ql, "packed_kernel_isa", lambda: "avx512_vnni")
    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: True)
    assert ql.resolve_weights_dtype("auto") == "int4"
    assert ql.resolve_weights_dtype("auto", [576, 1536]) == "int4"
    assert ql.resolve_weights_dtype("auto", [576, 100]) == "bfloat16"  # 100 is not a multiple of the group
    # A K-quant GGUF: 4 bits would re-quantize already quantized weights (Gemma 3 270M: +21.6% perplexity)
    assert ql.resolve_weights_dtype("auto", [640], exact_int4=False) == "int8"
    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: False)  # an AVX2-only CPU
    monkeypatch.setattr(ql, "packed_kernel_isa", lambda: "avx2")
    assert ql.resolve_weights_dtype("auto") == "int4"
    assert ql.resolve_weights_dtype("auto", exact_int4=False) == "int8"
    assert ql.resolve_weights_dtype("auto", [100]) == "float32"
    monkeypatch.setattr(ql, "packed_kernel_isa", lambda: "portable")  # no SIMD path: not worth it
    assert ql.resolve_weights_dtype("auto") == "float32"
    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: True)
    assert ql.resolve_weights_dtype("auto") == "bfloat16"
    assert ql.resolve_weights_dtype("int8") == "int8"
    monkeypatch.setattr(ql, "packed_kernel_isa", lambda: None)  # no kernels at all
    assert ql.resolve_weights_dtype("auto") == "bfloat16"
    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: False)
    assert ql.resolve_weights_dtype("auto") == "float32"
    with pytest.raises(ConfigError, match="needs kvserve's C\\+\\+ kernels"):
        ql.resolve_weights_dtype("int4")


def test_unknown_weights_dtypes_are_config_errors():
    with pytest.raises(ConfigError, match="weights_dtype must be one of auto, float32, bfloat16, int8, int4"):
        EngineConfig(weights_dtype="q4_k")
    with pytest.raises(ConfigError, match="weights_dtype must be one of"):
        ql.resolve_weights_dtype("fp4")


@needs_kernels
@pytest.mark.slow
def test_the_embedded_model_in_int4_agrees_with_float32_wherever_float32_is_sure(embedded):
    # Greedy equality over a whole answer is not what 4-bit weights and int8 activations promise: this
    # prompt's first token is a near tie in fp32 (logits 25.33 vs 25.24), and int4 picks the other one.
    # What must hold: teacher-forced on fp32's own greedy answer, int4 picks fp32's token wherever fp32's
    # margin is clear, and the distributions stay close (a wrong layout or scale breaks both).
    from kvserve.engine.engine import Engine
    from kvserve.engine.sample.sampling import SamplingParams
    from tests.helpers import run_to_finals

    tokenizer = embedded.require_tokenizer()
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=embedded)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    ids = torch.tensor(prompt + list(run_to_finals(engine)[request_id].outputs[0].token_ids))
    int4 = load_model(weights_dtype="int4")
    scored = slice(len(prompt) - 1, len(ids) - 1)
    exact = embedded.model(ids, torch.arange(len(ids)))[scored].log_softmax(-1)
    quantized = int4.model(ids, torch.arange(len(ids)))[scored].log_softmax(-1)
    top2 = exact.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 1.0
    assert int(sure.sum()) >= 16
    assert torch.equal(quantized.argmax(-1)[sure], exact.argmax(-1)[sure])
    kl = (exact.exp() * (exact - quantized)).sum(-1)
    assert float(kl.mean()) < 0.02, kl


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied", "qwen2-bias", "llama-head-dim"])
def test_held_weight_bytes_is_what_the_engine_holds(variant, tmp_path):
    directory = save_hf_model(build_hf_model(variant), tmp_path)
    dtypes = ["float32", "bfloat16"] + (["int8", "int4"] if ops.kernels() is not None else [])
    for dtype in dtypes:
        loaded = load_model(directory, weights_dtype=dtype)
        assert ql.held_weight_bytes(loaded.config, dtype) == sum(loaded.weight_bytes.values()), dtype


@needs_kernels
def test_auto_keeps_a_gguf_of_other_quantizations_out_of_int4(monkeypatch, tmp_path):
    # A GGUF whose layer matrices are Q8_0 (not 4-bit groups): "auto" holds them as int8 (exactly, here).
    from tests.helpers import write_gguf

    monkeypatch.setattr(ql, "packed_kernel_isa", lambda: "avx2")
    path = tmp_path / "q8.gguf"
    write_gguf(build_hf_model("llama-gqa"), path, {"proj": "Q8_0"})
    assert load_model(path, weights_dtype="auto").linear_dtype == "int8"


@needs_kernels
def test_an_engine_on_int4_weights_keeps_an_fp16_cache_by_default(tmp_path):
    from kvserve.engine.engine import Engine

    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    int4 = Engine(EngineConfig(kv_cache_memory="4MiB"), loaded=load_model(directory, weights_dtype="int4"))
    exact = Engine(EngineConfig(kv_cache_memory="4MiB"), loaded=load_model(directory))
    assert (int4.kv_spec.dtype, exact.kv_spec.dtype) == ("float16", "float32")
    assert int4.kv_cache.k[0].dtype == torch.float16


@needs_kernels
def test_group_quantized_weights_need_input_sizes_in_whole_groups(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    directory = save_hf_model(LlamaForCausalLM(config), tmp_path)
    with pytest.raises(ConfigError, match="groups of 32 inputs, and .* has 48; use bfloat16 or float32"):
        load_model(directory, weights_dtype="int4")
    assert load_model(directory, weights_dtype="auto").linear_dtype in ("bfloat16", "float32")
