"""Tiny random Qwen3.5 models (hybrid: Gated DeltaNet + full attention), and a GGUF writer that lays one out as
llama.cpp's converter does (convert_hf_to_gguf.py: Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.gguf_tensors import add_tensor, quant_type

# variant -> (transformers config class name, model class name, config overrides)
QWEN35_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen3.5's layout in small: 3 linear-attention layers then a full-attention one; 2 key heads serving 4 value
    # heads (grouped in Hugging Face's order, tiled in llama.cpp's), GQA, half of each head rotated.
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # ... and attention every second layer, as many key as value heads of another width, a 3-tap convolution,
    # tied embeddings, MQA, the default quarter of each head rotated.
    "qwen35-alternating-tied": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=3, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # Qwen3.5-MoE: every MLP 8 experts of 32 (the top 2, renormalised) and a shared expert of 64 behind its gate.
    "qwen35-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}


def _tiled_value_heads(tensor: torch.Tensor, dim: int, key_heads: int, value_heads: int) -> torch.Tensor:
    """Value heads along `dim` from grouped by key head to tiled (llama.cpp's `_reorder_v_heads`)."""
    shape = list(tensor.shape)
    per_key = value_heads // key_heads
    split = shape[:dim] + [key_heads, per_key, shape[dim] // value_heads] + shape[dim + 1:]
    return tensor.reshape(split).transpose(dim, dim + 1).reshape(shape)


def _grouped(name: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
    """A linear layer's matrix from the file's value-head order back to Hugging Face's (tiled -> grouped)."""
    key_heads, value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if key_heads == value_heads or ".linear_attn." not in name:
        return tensor
    per_key = value_heads // key_heads  # tiled is grouped with the two head indices swapped
    if "in_proj_qkv" in name:
        qk_rows = 2 * key_heads * cfg.linear_key_head_dim
        return torch.cat((tensor[:qk_rows], _tiled_value_heads(tensor[qk_rows:], 0, per_key, value_heads)))
    return _tiled_value_heads(tensor, 1 if "out_proj" in name else 0, per_key, value_heads)


def _converted(name: str, tensor: torch.Tensor, cfg) -> tuple[str, torch.Tensor]:
    """(Hugging Face name as llama.cpp's converter renames it, the tensor as it stores it)."""
    key_heads, value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if key_heads != value_heads and ".linear_attn." in name:
        qk_rows = 2 * key_heads * cfg.linear_key_head_dim
        if "in_proj_qkv" in name:
            tensor = torch.cat((tensor[:qk_rows], _tiled_value_heads(tensor[qk_rows:], 0, key_heads, value_heads)))
        elif "conv1d" in name:
            tensor = torch.cat((tensor[:qk_rows], _tiled_value_heads(tensor[qk_rows:], 0, key_heads, value_heads)))
        elif any(part in name for part in ("in_proj_z", "in_proj_a", "in_proj_b", "A_log", "dt_bias")):
            tensor = _tiled_value_heads(tensor, 0, key_heads, value_heads)
        elif "out_proj" in name:
            tensor = _tiled_value_heads(tensor, 1, key_heads, value_heads)
    if name.endswith(".A_log"):
        return name, -torch.exp(tensor)
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", tensor
    if "conv1d" in name:
        return name, tensor.squeeze()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, tensor + 1
    return name, tensor


def write_qwen35_gguf(model, path: Path, quant_types: dict[str, str] | None = None,
                      prediction_blocks: int = 0) -> dict[str, torch.Tensor]:
    """Write a transformers Qwen3_5ForCausalLM as llama.cpp's converter would (`qwen35`). `quant_types`: a
    substring of the HF name -> GGML type for 2-D weights (others F32); `prediction_blocks`: multi-token-
    prediction blocks after the layers, as the converter appends a checkpoint's `mtp.*` (random here: they are
    not run). Returns the weights as the file holds them, dequantized, in Hugging Face's terms (the reference)."""
    import gguf

    cfg = model.config
    moe = cfg.model_type == "qwen3_5_moe_text"
    writer = gguf.GGUFWriter(str(path), "qwen35moe" if moe else "qwen35")
    writer.add_block_count(cfg.num_hidden_layers + prediction_blocks)
    if prediction_blocks:
        writer.add_nextn_predict_layers(prediction_blocks)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if moe:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default; text positions are 1-D
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    interval = [kind == "full_attention" for kind in cfg.layer_types].index(True) + 1
    writer.add_full_attention_interval(interval)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35,
                                     cfg.num_hidden_layers)
    reference: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in hf_name:  # transformers' fused experts -> llama.cpp's stacked ones, kept F32
            block = hf_name.split(".")[2]
            if hf_name.endswith("gate_up_proj"):
                gate, up = tensor.float().chunk(2, dim=1)
                writer.add_tensor(f"blk.{block}.ffn_gate_exps.weight", gate.contiguous().numpy())
                writer.add_tensor(f"blk.{block}.ffn_up_exps.weight", up.contiguous().numpy())
            else:
                writer.add_tensor(f"blk.{block}.ffn_down_exps.weight", tensor.float().contiguous().numpy())
            reference[hf_name] = tensor.float().clone()
            continue
        name, stored = _converted(hf_name, tensor.float(), cfg)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = stored.contiguous().numpy()
        qtype = quant_type(hf_name, data, quant_types)
        held = add_tensor(writer, gguf_name, data, qtype)
        reference[hf_name] = tensor.float().clone() if qtype == "F32" else _grouped(hf_name, held, cfg)
    hidden = cfg.hidden_size
    last = cfg.num_hidden_layers - 1  # a full-attention layer: the prediction block's own layer is one
    for block in range(cfg.num_hidden_layers, cfg.num_hidden_layers + prediction_blocks):
        for name, tensor in model.state_dict().items():
            if name.startswith(f"model.layers.{last}.") and ".mlp.experts." not in name:
                renamed, stored = _converted(name, tensor.float(), cfg)
                gguf_name = names.get_name(renamed, try_suffixes=(".weight", ".bias")).replace(f"blk.{last}.",
                                                                                                f"blk.{block}.")
                writer.add_tensor(gguf_name, np.ascontiguousarray(stored.numpy()))
        writer.add_tensor(f"blk.{block}.nextn.eh_proj.weight", np.random.rand(hidden, 2 * hidden).astype(np.float32))
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            writer.add_tensor(f"blk.{block}.nextn.{norm}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
