"""A GGUF twin of a tiny transformers LFM2, laid out as llama.cpp's converter (LFM2Model) writes it: the layer
kinds as a per-layer head_count_kv array (0: a convolution layer), the MLP width as derived, the
convolution's weight squeezed to 2-D, the final norm named token_embd_norm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# llama.cpp's gguf-py tensor map for MODEL_ARCH.LFM2 (after `model.layers.N.`)
_LAYER_NAMES = {
    "operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight", "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "conv.conv.weight": "shortconv.conv.weight", "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.embedding_norm.weight": "token_embd_norm.weight", "lm_head.weight": "output.weight"}


def write_lfm2_gguf(model, path: Path, quant_types: dict[str, str]) -> dict[str, torch.Tensor]:
    """Write a transformers Lfm2ForCausalLM (without convolution biases: llama.cpp has none) as a GGUF file.
    `quant_types` maps a substring of the HF name to a GGML type the gguf package quantizes ("Q8_0", "F16");
    other tensors are F32. Returns the weights as the file holds them, in Hugging Face's terms and shapes."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = model.config
    if cfg.conv_bias:
        raise ValueError("llama.cpp's lfm2 has no convolution biases")
    writer = gguf.GGUFWriter(str(path), "lfm2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if kind != "conv" else 0 for kind in cfg.layer_types])
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_shortconv_l_cache(cfg.conv_L_cache)
    reference: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name in _GLOBAL_NAMES:
            gguf_name = _GLOBAL_NAMES[hf_name]
        else:
            _, _, index, rest = hf_name.split(".", 3)
            gguf_name = f"blk.{index}.{_LAYER_NAMES[rest]}"
        data = tensor.float().contiguous().numpy()
        if hf_name.endswith("conv.conv.weight"):
            data = data[:, 0]  # the converter's squeeze(1): ggml's conv takes [hidden, L]
        qtype = next((t for key, t in quant_types.items() if key in hf_name), "F32") if data.ndim == 2 else "F32"
        if qtype == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
            held = torch.from_numpy(data.copy())
        else:
            ggml_type = gguf.GGMLQuantizationType[qtype]
            packed = quantize(np.ascontiguousarray(data), ggml_type)
            writer.add_tensor(gguf_name, packed, raw_dtype=ggml_type)
            held = torch.from_numpy(dequantize(packed, ggml_type).copy()).view(data.shape).float()
        reference[hf_name] = held.reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
