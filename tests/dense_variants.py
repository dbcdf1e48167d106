"""Tiny random models of the dense families of issue 37 (SmolLM3, Phi-3 / Phi-4-mini, OLMo 2, Granite,
Ministral 3), and a GGUF writer that lays each out as llama.cpp's converter does (F32 tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Phi-3 with head_dim 16: 8 frequencies, 6 when 3/4 of each head rotates (Phi-4-mini's partial_rotary_factor).
_LONG_FACTORS = [1.0, 1.3, 1.9, 2.6, 4.1, 7.5]
_SHORT_FACTORS = [1.0, 1.05, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5]

# variant -> (transformers config class name, model class name, config overrides)
DENSE_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # four layers: the fourth has no RoPE
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # Phi-4-mini's shape: partial RoPE (3/4 of 16), LongRoPE on its long set (the context, 256, is past the
    # original 16: transformers picks the long set for sequences longer than 16, which the tests run)
    "phi4-mini-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        original_max_position_embeddings=16, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "long_factor": _LONG_FACTORS, "short_factor": [1.0] * 6}, tie_word_embeddings=True)),
    # Phi-3-mini's: full RoPE, the short set (context = original), a window that binds
    "phi3-short-window": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        original_max_position_embeddings=256, sliding_window=8, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [9.0] * 8,
            "short_factor": _SHORT_FACTORS})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.09, logits_scaling=8.0)),
    # Granite 4 dense (granite-4.0-micro's layout): attention-only, no experts, the shared MLP
    "granite4-dense": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.09, logits_scaling=8.0,
        num_local_experts=0, shared_intermediate_size=96, position_embedding_type="rope",
        layer_types=["attention"] * 3, attn_implementation="eager")),
    # YaRN over an original context of 16 (with its attention factor: mscale_all_dim 0, as llama.cpp reads it
    # back), so positions past 16 also get the query temperature
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
            "llama_4_scaling_beta": 0.1})),
}

_GGUF_ARCH = {"smollm3": "smollm3", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "ministral3": "mistral3",
              "granitemoehybrid": "granite"}  # an attention-only Granite 4 is converted as a Granite
_LLAMA_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# gguf-py's tensor maps for MODEL_ARCH.PHI3 and OLMO2
_LAYER_NAMES = {
    "phi3": {**_LLAMA_NAMES, "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "olmo2": {**_LLAMA_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
              "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"},
}
_PERMUTED = {"smollm3", "granite", "granitemoehybrid", "ministral3"}  # converted by llama.cpp's LlamaModel: Q/K rows permuted


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_metadata(writer, cfg, family: str) -> None:
    import gguf

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    for add, value in ((writer.add_block_count, cfg.num_hidden_layers),
                       (writer.add_context_length, cfg.max_position_embeddings),
                       (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, getattr(cfg, "shared_intermediate_size", cfg.intermediate_size)),
                       (writer.add_head_count, cfg.num_attention_heads),
                       (writer.add_head_count_kv, cfg.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps), (writer.add_vocab_size, cfg.vocab_size),
                       (writer.add_rope_freq_base, float(rope["rope_theta"])), (writer.add_key_length, head_dim),
                       (writer.add_value_length, head_dim)):
        add(value)
    if family == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"]))
                                             if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if family in ("granite", "granitemoehybrid"):  # GraniteModel.set_gguf_parameters
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if family == "ministral3":  # TextModel's YaRN keys, then Ministral3Model's two
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def write_family_gguf(model, path: Path) -> None:
    """Write a tiny transformers model of one of DENSE_VARIANTS' families as llama.cpp's converter would."""
    import gguf

    cfg = model.config
    family = cfg.model_type
    writer = gguf.GGUFWriter(str(path), _GGUF_ARCH[family])
    _write_metadata(writer, cfg, family)
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    layer_names = _LAYER_NAMES.get(family, _LLAMA_NAMES)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if hf_name in globals_:
            name = globals_[hf_name]
        else:
            _, _, index, rest = hf_name.split(".", 3)
            if rest == "shared_mlp.input_linear.weight":  # GraniteHybridModel.modify_tensors: gate, then up
                gate, up = np.split(data, 2)
                writer.add_tensor(f"blk.{index}.ffn_gate.weight", np.ascontiguousarray(gate))
                writer.add_tensor(f"blk.{index}.ffn_up.weight", np.ascontiguousarray(up))
                continue
            rest = {"shared_mlp.output_linear.weight": "mlp.down_proj.weight"}.get(rest, rest)
            name = f"blk.{index}.{layer_names[rest]}"
            if family in _PERMUTED and rest == "self_attn.q_proj.weight":
                data = _permute(data, cfg.num_attention_heads)
            elif family in _PERMUTED and rest == "self_attn.k_proj.weight":
                data = _permute(data, cfg.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
