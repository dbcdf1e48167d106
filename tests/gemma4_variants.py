"""Tiny random Gemma 4 models (kvserve.model.gemma4): every feature of the text decoder switched on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.gguf_tensors import add_tensor, quant_type

_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
          "sliding_attention", "sliding_attention", "full_attention"]

# variant -> (transformers config class name, model class name, config overrides)
GEMMA4_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Gemma 4 E2B/E4B's layout in small: sliding layers (window 8, shorter than the test sequences) and full
    # layers whose heads are wider (32) and fewer (1 KV head) with K = V, proportional RoPE on a quarter of their
    # frequencies, the last two layers reading layers 3's and 2's caches (with double-wide MLPs), per-layer
    # inputs (8 per layer), final logit soft-capping.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=160, final_logit_softcapping=30.0,
        sliding_window=8, layer_types=_TYPES, attn_implementation="eager")),
    # Every layer full attention (K = V, of one 32-wide KV head beside none other) and the last two reading layers
    # 2's and 3's caches: no window, so the context shift and the disk tier run on packed and shared layers.
    "gemma4-full": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=160, final_logit_softcapping=30.0,
        layer_types=["full_attention"] * 6, attn_implementation="eager")),
    # Gemma 4 26B-A4B's in small: a mixture of experts beside every dense MLP (8 experts of 32, the top 2),
    # K = V full layers of their own width, no PLE, no shared layers, untied head.
    "gemma4-moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32, sliding_window=6,
        final_logit_softcapping=30.0, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        attn_implementation="eager")),
}


def write_gemma4_gguf(model, path: Path, quant_types: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Write a transformers Gemma4ForCausalLM as llama.cpp's converter would (`gemma4`, convert_hf_to_gguf.py's
    Gemma4Model): norms as they are, the full layers' head shape and KV heads (per layer) and the MLP widths (per
    layer, when the sharing layers' are double) in the metadata, the proportional RoPE as `rope_freqs` (1 for the
    frequencies that turn, 1e30 for the rest), the router's scales as `ffn_gate_inp.scale` / `ffn_down_exps.scale`,
    the experts stacked as they are. `quant_types`: a substring of the HF name -> GGML type for 2-D weights (others
    F32). Returns the weights as the file holds them, dequantized, in Hugging Face's terms (the reference)."""
    import gguf

    cfg = model.config
    layers = model.model.layers
    kinds = list(cfg.layer_types)
    full = next(i for i, kind in enumerate(kinds) if kind == "full_attention")
    swa = next((i for i, kind in enumerate(kinds) if kind == "sliding_attention"), full)  # (none: the full's)
    swa_dim, full_dim = layers[swa].self_attn.head_dim, layers[full].self_attn.head_dim
    kv_heads = [cfg.num_attention_heads // layer.self_attn.num_key_value_groups for layer in layers]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    widths = [cfg.intermediate_size * (2 if cfg.use_double_wide_mlp and i >= first_shared else 1)
              for i in range(cfg.num_hidden_layers)]
    writer.add_feed_forward_length(widths if len(set(widths)) > 1 else widths[0])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else kv_heads[0])
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(swa_dim)
    writer.add_value_length_swa(swa_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(rope.get("sliding_attention", rope["full_attention"])["rope_theta"]))
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(swa_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.enable_moe_block:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k_experts)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    turning = int(full_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (full_dim // 2 - turning),
                                                     dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_hidden_layers)
    reference: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name.endswith("router.scale") or hf_name.endswith("per_expert_scale"):
            block = hf_name.split(".")[2]
            gguf_name = f"blk.{block}.{'ffn_gate_inp' if hf_name.endswith('router.scale') else 'ffn_down_exps'}.scale"
        else:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
            assert gguf_name is not None, hf_name
            gguf_name += "" if gguf_name.endswith(".weight") else ".weight"
        data = tensor.float().contiguous().numpy()
        reference[hf_name] = add_tensor(writer, gguf_name, data, quant_type(hf_name, data, quant_types))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
