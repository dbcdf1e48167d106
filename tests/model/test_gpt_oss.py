"""gpt-oss against transformers: a tiny random model from an HF directory and from GGUF files (F32, F16, Q8_0,
MXFP4 experts), with sequences longer than its sliding window."""

import json

import numpy as np
import pytest
import torch

from kvserve.errors import UnsupportedModelError
from kvserve.kernels import ops
from kvserve.model.checkpoint import read_config
from kvserve.model.gpt_oss import GptOssForCausalLM
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, paged_logits, reference_greedy, reference_logits, save_hf_model

WINDOW = 8
SEQUENCE_LEN = 32  # four windows: the sliding layers see less than the full ones
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
CHUNKINGS = {"prefill then decode": [12], "chunked prefill": [5, 3, 4, 7], "all decode": [1]}
TOLERANCE = 1e-4


def build_hf_gpt_oss(seed: int = 0):
    """Three layers (sliding, full, sliding), 8 experts of 32, top 4; YaRN as gpt-oss ships it."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=WINDOW,
        max_position_embeddings=256, rms_norm_eps=1e-5, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # norms at 1, biases and sinks at 0 would hide one loaded wrongly
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_gpt_oss()


def assert_matches(model, expected: torch.Tensor) -> None:
    for name, chunks in CHUNKINGS.items():
        diff = (paged_logits(model, TOKENS, chunks) - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
    recomputed = model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN))  # no cache: the contiguous context
    assert (recomputed - expected).abs().max().item() <= TOLERANCE


def greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    out = list(ids)
    for _ in range(num_tokens):
        logits = model(torch.tensor(out), torch.arange(len(out)), logits_indices=torch.tensor([len(out) - 1]))
        out.append(int(logits[0].argmax()))
    return out[len(ids):]


def test_hf_directory_matches_transformers(hf_model, tmp_path):
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    config = loaded.config
    assert isinstance(loaded.model, GptOssForCausalLM)
    assert config.layer_windows == (WINDOW, None, WINDOW) and config.rope_scaling.rope_type == "yarn"
    assert not config.rope_scaling.truncate
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 4, 32)
    assert loaded.model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    assert greedy(loaded.model, TOKENS[:8], 12) == reference_greedy(hf_model, TOKENS[:8], 12)


def test_sinks_window_and_routing_change_the_logits(hf_model, tmp_path):
    # The parity above would prove little if the sinks, the window or the router made no difference here.
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = reference_logits(hf_model, TOKENS)
    attention = model.layers[0].self_attn
    saved = attention.sinks.clone()
    attention.sinks.fill_(-1e4)  # no sink: the plain softmax
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
    attention.sinks.copy_(saved)
    attention.sliding_window = None
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
    attention.sliding_window = WINDOW
    moe = model.layers[1].mlp
    moe.softmax_over_top_k = False  # Qwen3-MoE's softmax over every expert
    assert (model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN)) - expected).abs().max() > 100 * TOLERANCE


def write_config(directory, hf_model, **changes):
    save_hf_model(hf_model, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"swiglu_limit": 10.0}, "limit 10.0"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 150000.0, "factor": 2.0}}, "'dynamic'"),
])
def test_unsupported_configs_are_named(hf_model, tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_config(write_config(tmp_path, hf_model, **changes))


def test_mxfp4_safetensors_experts_are_refused(hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = save_hf_model(hf_model, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = tensors.pop("model.layers.0.mlp.experts.down_proj")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="MXFP4 blocks"):
        load_model(directory)


# --- GGUF ----------------------------------------------------------------------------------------------

# what part of a name -> its GGML type (the rest F32); "exps": the stacked experts
GGUF_MIXES = {
    "f32": {},
    "f16": {"attn_": "F16", "exps.weight": "F16"},
    "q8_0": {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0",
             "attn_output.weight": "Q8_0", "exps.weight": "Q8_0", "token_embd": "Q8_0"},
    "mxfp4": {"exps.weight": "MXFP4", "attn_output.weight": "Q8_0", "output.weight": "Q8_0"},
}


def _gguf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's gpt-oss names, its experts split and stacked as the converter does."""
    cfg, state = model.config, model.state_dict()
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({f"blk.{i}.attn_norm.weight": state[p + "input_layernorm.weight"],
                    f"blk.{i}.post_attention_norm.weight": state[p + "post_attention_layernorm.weight"],
                    f"blk.{i}.attn_sinks.weight": state[p + "self_attn.sinks"],
                    f"blk.{i}.ffn_gate_inp.weight": state[p + "mlp.router.weight"],
                    f"blk.{i}.ffn_gate_inp.bias": state[p + "mlp.router.bias"]})
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            for kind in ("weight", "bias"):
                out[f"blk.{i}.attn_{ours}.{kind}"] = state[f"{p}self_attn.{theirs}.{kind}"]
        gate_up, gate_up_bias = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.gate_up_proj_bias"]
        out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :, ::2].transpose(1, 2)  # [E, I, hidden]
        out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, :, 1::2].transpose(1, 2)
        out[f"blk.{i}.ffn_down_exps.weight"] = state[p + "mlp.experts.down_proj"].transpose(1, 2)  # [E, hidden, I]
        out[f"blk.{i}.ffn_gate_exps.bias"] = gate_up_bias[:, ::2]
        out[f"blk.{i}.ffn_up_exps.bias"] = gate_up_bias[:, 1::2]
        out[f"blk.{i}.ffn_down_exps.bias"] = state[p + "mlp.experts.down_proj_bias"]
    return out


def _as_hf_state(held: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """What the file holds, back in transformers' layout (the reference model's weights)."""
    state = {"model.embed_tokens.weight": held["token_embd.weight"], "model.norm.weight": held["output_norm.weight"],
             "lm_head.weight": held["output.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        gate, up = held[b + "ffn_gate_exps.weight"].transpose(1, 2), held[b + "ffn_up_exps.weight"].transpose(1, 2)
        state[p + "mlp.experts.gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2)  # re-interleaved
        state[p + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            [held[b + "ffn_gate_exps.bias"], held[b + "ffn_up_exps.bias"]], dim=-1).flatten(-2)
        state[p + "mlp.experts.down_proj"] = held[b + "ffn_down_exps.weight"].transpose(1, 2)
        state[p + "mlp.experts.down_proj_bias"] = held[b + "ffn_down_exps.bias"]
        state[p + "mlp.router.weight"], state[p + "mlp.router.bias"] = (held[b + "ffn_gate_inp.weight"],
                                                                      held[b + "ffn_gate_inp.bias"])
        state[p + "self_attn.sinks"] = held[b + "attn_sinks.weight"]
        state[p + "input_layernorm.weight"] = held[b + "attn_norm.weight"]
        state[p + "post_attention_layernorm.weight"] = held[b + "post_attention_norm.weight"]
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            for kind in ("weight", "bias"):
                state[f"{p}self_attn.{theirs}.{kind}"] = held[f"{b}attn_{ours}.{kind}"]
    return state


def write_gpt_oss_gguf(model, path, quant_types: dict[str, str]) -> dict[str, torch.Tensor]:
    """A llama.cpp-style `gpt-oss` GGUF of `model`; returns what the file holds in transformers' layout."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = model.config
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    held = {}
    for name, tensor in _gguf_tensors(model).items():
        data = np.ascontiguousarray(tensor.float().numpy())
        qtype = next((t for key, t in quant_types.items() if key in name), "F32") if data.ndim >= 2 else "F32"
        if qtype == "F32":
            writer.add_tensor(name, data)
            held[name] = torch.from_numpy(data.copy())
            continue
        ggml_type = gguf.GGMLQuantizationType[qtype]
        packed = quantize(data, ggml_type)
        writer.add_tensor(name, packed, raw_dtype=ggml_type)
        held[name] = torch.from_numpy(np.asarray(dequantize(packed, ggml_type), dtype=np.float32).copy()).view(
            data.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _as_hf_state(held, cfg)


@pytest.mark.parametrize("mix", sorted(GGUF_MIXES))
def test_gguf_matches_dequantized_reference(mix, tmp_path):
    hf_model = build_hf_gpt_oss()
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_gpt_oss_gguf(hf_model, path, GGUF_MIXES[mix]))
    loaded = load_model(path, weights_dtype="float32")
    assert isinstance(loaded.model, GptOssForCausalLM) and loaded.config.architecture == "gpt-oss"
    assert loaded.config.layer_windows == (WINDOW, None, WINDOW) and not loaded.config.rope_scaling.truncate
    if mix == "mxfp4":
        assert "MXFP4" in loaded.weight_format
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    assert greedy(loaded.model, TOKENS[:8], 12) == reference_greedy(hf_model, TOKENS[:8], 12)


# --- engine and memory ------------------------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not ops.available(), reason="the C++ kernels are not built")


@needs_kernels
@pytest.mark.parametrize("weights_dtype", ["int4", "int8"])
def test_mxfp4_experts_are_held_as_the_files_own_values(weights_dtype, tmp_path):
    """Experts from an MXFP4 file hold its 4-bit codes and their table of levels (doubled E2M1 value + 12,
    scale 2^(e - 128)), under int4 and int8 alike: its weights exactly, in 4-bit groups' bytes; not a
    re-quantization of them (min / max groups over {0, +-0.5, .., +-6} x 2^e are off by ~1e-3)."""
    from kvserve.kernels.packing import packed_bytes
    from tests.helpers import int8_activation_matmul

    from kvserve.model.gguf import load_gguf

    path = tmp_path / "tiny.gguf"
    write_gpt_oss_gguf(build_hf_gpt_oss(), path, GGUF_MIXES["mxfp4"])
    # The experts' fp32 is never made (a 20B model's would not fit): they stream as shapes only.
    streamed = dict(load_gguf(path).weights(codes_held=True))
    experts = [name for name in streamed if ".experts." in name and name.endswith("proj.weight")]
    assert experts and all(streamed[name].is_meta for name in experts)
    # Beside them only the attention outputs' Q8_0 groups, also held as their codes; nothing else.
    others = sorted(name for name, value in streamed.items() if value.is_meta and name not in experts)
    assert others == sorted(name for name in streamed if name.endswith("o_proj.weight"))
    packed, exact = load_model(path, weights_dtype=weights_dtype), load_model(path, weights_dtype="float32")
    for layer_index in range(len(packed.model.layers)):
        for expert in (0, 3):
            for name in ("gate_up_proj", "down_proj"):
                layer = packed.model.layers[layer_index].mlp.experts[expert].get_submodule(name)
                assert layer.code_table.tolist() == [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0]
                # The offsets are -12 x scale: a zero point of 12 stands for them (not held).
                assert layer.method.zero == 12
                assert layer.packed.numel() == packed_bytes(layer.output_size, layer.input_size, 4, offsets=False)
                reference = exact.model.layers[layer_index].mlp.experts[expert].get_submodule(name)
                x = torch.randn(3, layer.input_size)
                expected = int8_activation_matmul(x, reference.weight) + reference.bias
                assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max(), name


@pytest.mark.slow
@needs_kernels
def test_engine_tokens_are_the_same_cold_cached_chunked_and_drafted(hf_model, tmp_path):
    from kvserve.engine.sample.sampling import SamplingParams
    from tests.engine.test_batch_invariance import Oracle, run

    # int4, as "auto" holds a full-size model's (a model this small resolves to float32): experts as group codes
    loaded = load_model(save_hf_model(hf_model, tmp_path), weights_dtype="int4")
    assert loaded.linear_dtype == "int4"
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=rng).tolist() for n in (37, 9, 22)]
    params = [SamplingParams(max_tokens=10, temperature=t, seed=s, ignore_eos=True, logprobs=0)
              for t, s in ((0.0, None), (0.9, 1), (0.0, None))]
    alone = [run(loaded, [p], [sp], enable_prefix_caching=False)[0] for p, sp in zip(prompts, params)]
    assert run(loaded, prompts, params, max_num_batched_tokens=16) == alone  # batched, 16-token chunks
    assert run(loaded, prompts, params, warm=[prompts[0][:30]]) == alone  # a cached prefix
    oracle = Oracle({tuple(p): out[0] for p, out in zip(prompts, alone)}, TINY_VOCAB)
    assert run(loaded, prompts, params, proposer=oracle, k=3) == alone  # drafts verified
    assert oracle.accepted > 0


def test_memory_plan_counts_windows_per_layer_and_no_kv_for_sinks(hf_model, tmp_path):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.planner import plan, resolve_model

    directory = save_hf_model(hf_model, tmp_path)
    name, config, params = resolve_model(str(directory))
    assert config.layer_windows == (WINDOW, None, WINDOW)
    result = plan(name, config, params, context=37, kv_dtype="float32", block_size=16)
    engine = Engine(EngineConfig(kv_cache_memory=result.kv_bytes_total, kv_cache_dtype="float32", block_size=16,
                                 max_num_seqs=1), loaded=load_model(directory))
    assert engine.kv_spec.bytes_per_token == result.bytes_per_token == 3 * 2 * 16 * 2 * 4  # sinks: no K/V
    assert engine.kv_cache.bytes_allocated == result.kv_bytes_total
    assert {group.window for group in engine.kv_spec.layout.groups} == {WINDOW, None}
    # The sliding layers keep only their window's blocks: two of the three layers hold less than 37 tokens.
    assert result.kv_bytes_per_request < result.kv_bytes_per_request_unwindowed == 48 * result.bytes_per_token


def test_catalog_gpt_oss_sizes_and_windowed_kv():
    from kvserve.model.catalog import KNOWN_MODELS, num_parameters
    from kvserve.planner import plan

    assert num_parameters(KNOWN_MODELS["gpt-oss-20b"]) / 1e9 == pytest.approx(20.91, abs=0.01)
    assert num_parameters(KNOWN_MODELS["gpt-oss-120b"]) / 1e9 == pytest.approx(116.8, abs=0.1)
    config = KNOWN_MODELS["gpt-oss-20b"]
    result = plan("gpt-oss-20b", config, num_parameters(config), context=8192, kv_dtype="float16")
    full_layers = 12 * 8192 * 8 * 64 * 2 * 2  # the 12 full layers hold every token; the 12 windowed far fewer
    assert full_layers < result.kv_bytes_per_request < full_layers * 1.05
