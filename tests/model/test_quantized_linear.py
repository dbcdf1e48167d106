import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.errors import ConfigError
from kvserve.model import quantized_linear as ql
from kvserve.model.layers import Linear
from kvserve.model.loader import load_model
from tests.helpers import build_hf_model, save_hf_model

needs_bf16 = pytest.mark.skipif(not ql.has_fast_bf16_matmul(), reason="no native bf16 GEMM on this CPU")


def _linear(rows: int, cols: int, bias: bool = False, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(cols, rows, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


def test_a_q4_1_weight_round_trips_exactly_with_fp32_scales():
    # Q4_1 blocks as llama.cpp writes them: codes 0..15 with 0 and 15 present in every group.
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.int32)
    codes[:, ::32], codes[:, 1::32] = 0, 15
    d = torch.rand(8, 2) * 0.1 + 0.01
    m = -torch.rand(8, 2)
    weight = codes.view(8, 2, 32).float() * d[..., None] + m[..., None]
    q, scales, zeros = ql.quantize_int4_groups(weight.view(8, 64))
    assert torch.equal(q, codes)
    exact = ql.dequantize_int4_groups(q, torch.stack([scales.T, zeros.T], dim=-1))
    torch.testing.assert_close(exact, weight.view(8, 64), rtol=0, atol=1e-6)
    # The kernel holds scale and zero in bf16: the weight moves by bf16's rounding, no more.
    rounded = ql.dequantize_int4_groups(q, torch.stack([scales.T, zeros.T], dim=-1).bfloat16())
    assert ((rounded - exact).norm() / exact.norm()) < 2**-8


@needs_bf16
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, ql.PACKED_MAX_ROWS, ql.PACKED_MAX_ROWS + 1, 33])
def test_each_method_multiplies_by_the_weight_it_holds(dtype, rows):
    layer = _linear(160, 64, bias=True)
    reference = _linear(160, 64, bias=True)
    layer.method = ql._METHODS[dtype]()
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(rows, 64)
    held = layer.weight.float()  # the dequantized weight both kernels multiply by
    expected = x.bfloat16().float() @ held.T + layer.bias
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 160)
    # bf16 accumulation/output rounding only (a wrong layout or scale is off by far more).
    assert (out - expected).norm() / expected.norm() < 1e-2
    # And it is close to the fp32 layer it came from.
    error = (out - reference(x)).norm() / reference(x).norm()
    assert error < {"bfloat16": 0.01, "int8": 0.02, "int4": 0.15}[dtype]


@needs_bf16
def test_converting_a_model_keeps_the_parameter_count_and_holds_fewer_bytes(tmp_path):
    directory = save_hf_model(build_hf_model("llama-mha-tied"), tmp_path)
    exact = load_model(directory)
    int4 = load_model(directory, weights_dtype="int4")
    assert int4.linear_dtype == "int4"
    assert int4.model.num_parameters() == exact.model.num_parameters()
    assert sum(int4.weight_bytes.values()) != sum(exact.weight_bytes.values())
    assert "uint8" in int4.weight_bytes and "int8" in int4.weight_bytes  # int4 layers, int8 head
    assert isinstance(int4.model.lm_head.method, ql.Int8LinearMethod)
    # The tied embedding stays fp32 for lookups; the head got its own copy.
    assert int4.model.embed_tokens.weight.dtype == torch.float32
    assert exact.model.lm_head.weight is exact.model.embed_tokens.weight
    ids = torch.arange(1, 20)
    a, b = exact.model(ids, torch.arange(19)), int4.model(ids, torch.arange(19))
    assert (b - a).norm() / a.norm() < 0.2


def test_float32_is_the_model_as_loaded(tmp_path):
    directory = save_hf_model(build_hf_model("llama-gqa"), tmp_path)
    loaded = load_model(directory, weights_dtype="float32")
    assert loaded.linear_dtype == "float32" and set(loaded.weight_bytes) == {"float32"}


def test_auto_picks_by_the_cpu(monkeypatch):
    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: True)
    assert ql.resolve_weights_dtype("auto") == "int4"
    assert ql.resolve_weights_dtype("auto", [576, 1536]) == "int4"
    assert ql.resolve_weights_dtype("auto", [576, 100]) == "int8"  # 100 is not a multiple of the int4 group
    # A K-quant GGUF: int4 would re-quantize already quantized weights (Gemma 3 270M: +15.8% perplexity).
    assert ql.resolve_weights_dtype("auto", [640], exact_int4=False) == "bfloat16"
    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: False)
    assert ql.resolve_weights_dtype("auto") == "float32"
    assert ql.resolve_weights_dtype("auto", exact_int4=False) == "float32"
    assert ql.resolve_weights_dtype("int8") == "int8"


def test_unknown_weights_dtypes_are_config_errors():
    with pytest.raises(ConfigError, match="weights_dtype must be one of auto, float32, bfloat16, int8, int4"):
        EngineConfig(weights_dtype="q4_k")
    with pytest.raises(ConfigError, match="weights_dtype must be one of"):
        ql.resolve_weights_dtype("fp4")


@needs_bf16
@pytest.mark.slow
def test_the_embedded_model_in_int4_keeps_float32s_greedy_answer(embedded):
    from kvserve.engine.engine import Engine
    from kvserve.engine.sampling import SamplingParams
    from tests.helpers import run_to_finals

    tokenizer = embedded.require_tokenizer()
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    answers = []
    for loaded in (embedded, load_model(weights_dtype="int4")):
        engine = Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=loaded)
        request_id = engine.add_request(prompt, params)
        answers.append(run_to_finals(engine)[request_id].outputs[0].token_ids)
    assert answers[0] == answers[1], [tokenizer.decode(a) for a in answers]


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied", "qwen2-bias", "llama-head-dim"])
def test_held_weight_bytes_is_what_the_engine_holds(variant, tmp_path):
    directory = save_hf_model(build_hf_model(variant), tmp_path)
    dtypes = ["float32"] + (["bfloat16", "int8", "int4"] if ql.has_fast_bf16_matmul() else [])
    for dtype in dtypes:
        loaded = load_model(directory, weights_dtype=dtype)
        assert ql.held_weight_bytes(loaded.config, dtype) == sum(loaded.weight_bytes.values()), dtype


def test_auto_keeps_a_k_quant_gguf_out_of_int4(monkeypatch, tmp_path):
    # A GGUF whose layer matrices are Q8_0 (not int4 groups): "auto" holds bf16 where bf16 is fast.
    from tests.helpers import build_hf_model, write_gguf

    monkeypatch.setattr(ql, "has_fast_bf16_matmul", lambda: True)
    path = tmp_path / "q8.gguf"
    write_gguf(build_hf_model("llama-gqa"), path, {"proj": "Q8_0"})
    assert load_model(path, weights_dtype="auto").linear_dtype == "bfloat16"
