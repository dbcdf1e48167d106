"""`kvserve memory`: the seeds' worked figures, and agreement with the engine's allocator to the byte."""

import json
import math

import pytest

from kvserve.cli import main
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.model.catalog import KNOWN_MODELS, num_parameters
from kvserve.model.quantized_linear import held_weight_bytes
from kvserve.kv.groups.layout import blocks_held
from kvserve.planner import describe, plan, resolve_model

GiB, MiB = 2**30, 2**20
DTYPES = ["float32", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2", "int8/int4"]


def test_seed_figures_gqa_8b_at_128k():
    name, config, params = resolve_model("Llama-3.1-8B")
    result = plan(name, config, params, context=128 * 1024, kv_dtype="float16")
    assert result.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
    assert result.kv_bytes_per_request == 16 * GiB


def test_seed_figures_7b_mha_hundred_requests_of_1k():
    name, config, params = resolve_model(None, layers=32, kv_heads=32, head_dim=128, params=7e9, context=1024)
    result = plan(name, config, params, context=1024, batch=100, kv_dtype="float16")
    assert result.bytes_per_token == 512 * 1024  # 0.5 MiB per token
    assert result.kv_bytes_total == 50 * GiB
    assert result.weights_bytes == 14e9


def test_known_models_have_their_published_sizes():
    billions = {name: num_parameters(config) / 1e9 for name, config in KNOWN_MODELS.items()}
    assert billions["Llama-2-7B"] == pytest.approx(6.74, abs=0.01)
    assert billions["Llama-3.1-8B"] == pytest.approx(8.03, abs=0.01)
    assert billions["Llama-3.1-70B"] == pytest.approx(70.55, abs=0.05)
    assert billions["Mistral-7B"] == pytest.approx(7.25, abs=0.01)
    assert billions["SmolLM2-135M"] == pytest.approx(0.1345, abs=0.0005)
    assert KNOWN_MODELS["Llama-2-7B"].attention_kind == "MHA" and KNOWN_MODELS["Qwen2.5-7B"].num_kv_heads == 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_planner_and_allocator_agree_to_the_byte(tiny_models, dtype):
    loaded = tiny_models("llama-gqa")
    name, config, params = resolve_model(loaded.source)  # read back from the checkpoint directory
    assert config == loaded.config
    result = plan(name, config, params, context=37, batch=3, kv_dtype=dtype, block_size=16)
    # A batch of three: the pool keeps room for three requests' blocks being filled (int4 keys).
    engine = Engine(EngineConfig(kv_cache_memory=result.kv_bytes_total, kv_cache_dtype=dtype, block_size=16,
                                 max_num_seqs=3), loaded=loaded)
    assert engine.kv_spec.bytes_per_token == result.bytes_per_token
    assert engine.kv_cache.bytes_allocated == result.kv_bytes_total
    assert engine.kv_manager.num_blocks == 3 * 3  # ceil(37 / 16) blocks for each of the three requests


def test_what_fits_in_a_memory_budget():
    name, config, params = resolve_model("Llama-3.1-70B")
    budget = 160 * GiB
    result = plan(name, config, params, context=8192, batch=16, kv_dtype="int8", memory_bytes=budget)
    n = result.max_concurrent_requests
    fits = plan(name, config, params, context=8192, batch=n, kv_dtype="int8")
    too_many = plan(name, config, params, context=8192, batch=n + 1, kv_dtype="int8")
    assert fits.total_bytes <= budget < too_many.total_bytes
    longest = plan(name, config, params, context=result.max_context_for_batch, batch=16, kv_dtype="int8")
    assert longest.total_bytes <= budget
    assert plan(name, config, params, context=result.max_context_for_batch + 16, batch=16,
                kv_dtype="int8").total_bytes > budget


def test_gguf_shape_is_read_without_the_weights(embedded):
    name, config, params = resolve_model(embedded.source)
    assert config == embedded.config and params == embedded.model.num_parameters()


def test_cli_json_and_errors(capsys):
    assert main(["memory", "SmolLM2-135M", "--context", "4096", "--batch", "8", "--kv-dtype", "int8", "--json",
                 "--memory", "2GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 30 * 3 * 2 * (64 + 2)
    assert out["kv_bytes_per_request"] == 4096 * out["bytes_per_token"]
    assert out["kv_bytes_total"] == 8 * out["kv_bytes_per_request"]
    assert out["max_concurrent_requests"] > 8
    assert main(["memory", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["memory", "--layers", "4"]) == 2
    assert main(["memory", "SmolLM2-135M", "--kv-dtype", "int3"]) == 2


def test_memory_weights_dtype_agrees_with_what_the_engine_holds(embedded, capsys):
    # float32 here; the other dtypes are checked layer by layer in tests/model/test_quantized_linear.py.
    assert main(["memory", embedded.source, "--weights-dtype", "float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_bytes"] == sum(embedded.weight_bytes.values())
    name, config, params = resolve_model(embedded.source)
    assert plan(name, config, params, context=1024, weights_dtype="auto").weights_bytes == \
        held_weight_bytes(config, "auto")
    assert plan(name, config, params, context=1024, weights_dtype="q4_0").weights_bytes == math.ceil(params * 18 / 32)


def test_windowed_layers_hold_only_their_window_in_the_plan():
    from kvserve.config import ModelConfig

    shape = dict(architecture="custom", vocab_size=0, hidden_size=640, intermediate_size=0, num_layers=18,
                 num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_theta=1e6)
    gemma_like = ModelConfig(**shape, sliding_window=512, layer_windows=((512,) * 5 + (None,)) * 3)
    result = plan("gemma-like", gemma_like, 0, context=32768, kv_dtype="float32", block_size=16)
    page = 16 * 3 * 2 * 256 * 4  # a block of one group: 16 tokens x 3 layers x (K + V) x 256 x 4 B
    assert result.kv_bytes_per_request == (2048 + 5 * 32) * page  # the global group's 2048 blocks + 32 per window
    assert result.kv_bytes_per_request_unwindowed == 32768 * 18 * 2 * 256 * 4
    assert "KV groups: 6 groups of 3 layers: 5 windowed (512 tokens), 1 full attention" in describe(result)
    # Only windows: memory stops bounding the context once they are full; the model's limit is the answer.
    windowed = ModelConfig(**shape, sliding_window=512)
    roomy = plan("windowed", windowed, 0, context=4096, kv_dtype="float32", memory_bytes=2 * GiB)
    assert roomy.max_context_for_batch == 32768
    tight = plan("gemma-like", gemma_like, 0, context=4096, kv_dtype="float32", memory_bytes=GiB // 4, batch=2)
    fits = plan("gemma-like", gemma_like, 0, context=tight.max_context_for_batch, kv_dtype="float32", batch=2)
    assert fits.kv_bytes_total <= tight.kv_room_bytes
    over = plan("gemma-like", gemma_like, 0, context=tight.max_context_for_batch + 16, kv_dtype="float32", batch=2)
    assert over.kv_bytes_total > tight.kv_room_bytes


def test_the_served_name_and_no_name_plan_the_embedded_model(capsys):
    assert main(["memory", "SmolLM2-135M-Instruct", "--json"]) == 0
    by_served_name = json.loads(capsys.readouterr().out)
    assert main(["memory", "--json"]) == 0  # no model: the one `kvserve serve` runs without --model
    embedded = json.loads(capsys.readouterr().out)
    assert embedded["model"] == "SmolLM2-135M-Instruct"
    assert (by_served_name["bytes_per_token"], by_served_name["model_max_context"]) == \
        (embedded["bytes_per_token"], embedded["model_max_context"]) == (30 * 3 * 2 * 64 * 2, 8192)


def test_the_largest_context_stops_at_the_models_and_the_rest_buys_requests(capsys):
    assert main(["memory", "SmolLM2-135M", "--memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    name, config, params = resolve_model("SmolLM2-135M")
    result = plan(name, config, params, context=8192, memory_bytes=4 * GiB)
    assert result.max_context_for_batch == 8192 and result.context_capped_by_model
    requests = result.max_requests_at_max_context
    assert requests > 1 and plan(name, config, params, context=8192, batch=requests).total_bytes <= 4 * GiB
    assert plan(name, config, params, context=8192, batch=requests + 1).total_bytes > 4 * GiB
    assert (f"largest context for 1 concurrent request(s): 8,192 tokens (the model's context; the budget holds "
            f"{requests:,} concurrent requests of 8,192 tokens)") in out
    # A budget smaller than the model's context is not capped.
    tight = plan(name, config, params, context=8192, memory_bytes=400 * 2**20)
    assert 0 < tight.max_context_for_batch < 8192 and not tight.context_capped_by_model


# Hybrid models: K/V for the attention layers only, plus one float32 recurrent state per request. Figures by hand
# from each published config.json (float16 K/V; the state is float32, 4 B):
#   Qwen3.5-0.8B: 24 layers, full attention every 4th -> 6 attention, 18 Gated DeltaNet; 2 KV heads of 256.
#     K/V: 6 x 2 heads x 2 (K, V) x 256 x 2 B = 12,288 bytes/token.
#     state: conv_dim = 2 x 16 key heads x 128 + 16 value heads x 128 = 6,144; conv window 6,144 x (4 - 1) = 18,432;
#     per value head 128 x 128: 16 x 16,384 = 262,144; (18,432 + 262,144) x 4 B = 1,122,304 x 18 = 20,201,472.
#   Qwen3.5-4B: 32 layers -> 8 attention, 24 recurrent; 4 KV heads of 256: 8 x 4 x 2 x 256 x 2 = 32,768.
#     conv_dim = 2 x 16 x 128 + 32 x 128 = 8,192; 8,192 x 3 = 24,576; 32 x 128 x 128 = 524,288;
#     (24,576 + 524,288) x 4 = 2,195,456 x 24 = 52,690,944.
#   LFM2-350M: 16 layers, attention at 2, 5, 8, 10, 12, 14 -> 6 attention, 10 short convs; 8 KV heads of 64:
#     6 x 8 x 2 x 64 x 2 = 12,288; conv state hidden 1,024 x (L_cache 3 - 1) x 4 B = 8,192 x 10 = 81,920.
#   LFM2-1.2B: the same layers at hidden 2,048: 12,288 bytes/token; 2,048 x 2 x 4 = 16,384 x 10 = 163,840.
HYBRIDS = {
    "Qwen3.5-0.8B": (6, 12_288, 18, 20_201_472),
    "Qwen3.5-4B": (8, 32_768, 24, 52_690_944),
    "LFM2-350M": (6, 12_288, 10, 81_920),
    "LFM2-1.2B": (6, 12_288, 10, 163_840),
}


@pytest.mark.parametrize("model", HYBRIDS)
def test_hybrid_models_count_kv_per_token_and_state_per_request(model):
    attention, per_token, recurrent, per_state = HYBRIDS[model]
    name, config, params = resolve_model(model)
    result = plan(name, config, params, context=8192, batch=3, kv_dtype="float16")
    assert (result.attention_layers, result.bytes_per_token) == (attention, per_token)
    assert (result.recurrent_layers, result.state_bytes_per_request) == (recurrent, per_state)
    assert result.kv_bytes_per_request == 8192 * per_token
    assert result.bytes_per_request == 8192 * per_token + per_state  # its context's K/V and one live state
    assert result.state_bytes_total == 3 * per_state
    assert result.total_bytes == result.weights_bytes + result.kv_bytes_total + 3 * per_state + result.overhead_bytes
    line = (f"K/V (float16): {per_token:,} bytes/token for {attention} attention layers ({result.formula}) + "
            f"recurrent state (float32): {per_state:,} bytes/request for {recurrent} recurrent layers "
            f"({result.state_formula})")
    assert line in describe(result).splitlines()
    assert result.state_formula.endswith(f"= {per_state:,} bytes/state")


def test_hybrid_parameters_count_the_recurrent_mixers():
    # LFM2's published sizes: 354M and 1.17B (a short conv layer: in_proj 3 x hidden^2, out_proj hidden^2).
    assert num_parameters(KNOWN_MODELS["LFM2-350M"]) / 1e9 == pytest.approx(0.354, abs=0.001)
    assert num_parameters(KNOWN_MODELS["LFM2-1.2B"]) / 1e9 == pytest.approx(1.17, abs=0.01)


def test_what_fits_a_budget_counts_each_requests_live_state():
    name, config, params = resolve_model("Qwen3.5-0.8B")
    budget = 4 * GiB
    result = plan(name, config, params, context=32768, batch=4, memory_bytes=budget)
    n = result.max_concurrent_requests
    assert plan(name, config, params, context=32768, batch=n).total_bytes <= budget
    assert plan(name, config, params, context=32768, batch=n + 1).total_bytes > budget
    # Without the states (20 MB a request) more requests would seem to fit.
    kv_only = result.kv_room_bytes // result.kv_bytes_per_request
    assert n < kv_only and n == result.kv_room_bytes // result.bytes_per_request
    longest = result.max_context_for_batch
    assert plan(name, config, params, context=longest, batch=4).total_bytes <= budget
    assert plan(name, config, params, context=longest + 16, batch=4).total_bytes > budget


def test_cli_prints_and_jsons_the_state(capsys):
    assert main(["memory", "LFM2-350M", "--context", "4096", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["bytes_per_token"], out["state_bytes_per_request"], out["recurrent_layers"]) == (12_288, 81_920, 10)
    assert out["state_formula"] == "10 recurrent layers x (1,024 x 2) x 4 B = 81,920 bytes/state"
    assert out["bytes_per_request"] == 4096 * 12_288 + 81_920 and out["state_bytes_total"] == 2 * 81_920
    assert main(["memory", "Qwen3.5-0.8B", "--context", "1024"]) == 0
    text = capsys.readouterr().out
    assert "+ recurrent state (float32): 20,201,472 bytes/request for 18 recurrent layers" in text
    assert main(["memory", "--list"]) == 0
    assert "18 (20,201,472)" in capsys.readouterr().out
    # A model whose every layer attends prints as before: no state line.
    assert main(["memory", "SmolLM2-135M", "--json"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert (dense["recurrent_layers"], dense["state_bytes_per_request"], dense["attention_layers"]) == (0, 0, 30)


def test_planner_and_engine_agree_on_a_hybrid_model():
    from tests.engine.test_hybrid_state import engine_for
    from tests.toy_hybrid import toy_hybrid

    loaded = toy_hybrid()
    result = plan("toy", loaded.config, loaded.model.num_parameters(), context=64, kv_dtype="float32")
    engine = engine_for(loaded)
    assert engine.kv_spec.bytes_per_token == result.bytes_per_token == 2 * 2 * 2 * 8 * 4  # 2 attention layers
    # Two toy recurrent layers of (32 x 2 + 32) float32: 2 x 96 x 4 = 768 bytes.
    assert engine.stats().states.slot_bytes == result.state_bytes_per_request == 768


def test_gemma4_plans_what_its_layers_store():
    """E2B: 15 layers store (12 sliding of one 256-wide KV head, 3 full of one 512-wide head spanning two
    slots), 20 read an earlier layer's cache; the full layers hold the whole context, the sliding ones their
    window. Every layer storing its own would hold what all 35 need."""
    name, config, params = resolve_model("Gemma-4-E2B")
    assert params / 1e9 == pytest.approx(4.63, abs=0.01)  # the text decoder (the published 5.1B has its encoders)
    result = plan(name, config, params, context=32768, kv_dtype="float16", block_size=16)
    assert result.bytes_per_token == 18 * 2 * 256 * 2 and result.attention_layers == 35
    window = blocks_held(512, 32768, 16) * 16  # the tokens a sliding layer holds: its window's blocks
    sliding, full = 12 * window, 3 * 2 * 32768  # token-slots held: sliding layers, full ones (2 slots each)
    assert result.kv_bytes_per_request == (sliding + full) * 2 * 256 * 2
    # 28 sliding and 7 full layers, each its own K and V (a full one's 512-wide head: two slots)
    assert result.kv_bytes_per_request_unshared == (28 * window + 7 * 2 * 32768) * 2 * 256 * 2
    # E4B in 16 GiB (fp16 weights): the savings buy most of the context
    name, config, params = resolve_model("Gemma-4-E4B")
    budget = plan(name, config, params, context=32768, kv_dtype="float16", memory_bytes=16 * GiB)
    assert budget.max_context_for_batch > 1.5 * budget.max_context_unshared > 0
    assert plan(name, config, params, context=budget.max_context_for_batch, kv_dtype="float16").total_bytes <= 16 * GiB


def test_planner_and_engine_agree_on_gemma4(tiny_models):
    loaded = tiny_models("gemma4")
    result = plan("gemma4", loaded.config, loaded.model.num_parameters(), context=40, kv_dtype="float32",
                  block_size=16)
    engine = Engine(EngineConfig(kv_cache_memory=result.kv_bytes_total, kv_cache_dtype="float32", block_size=16,
                                 weights_dtype="float32"), loaded=loaded)
    assert engine.kv_spec.bytes_per_token == result.bytes_per_token
    assert engine.kv_cache.bytes_allocated == result.kv_bytes_total
    assert result.kv_bytes_per_request_unshared > result.kv_bytes_per_request
