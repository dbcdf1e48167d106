"""Qwen3 and Qwen3-MoE (Qwen3ForCausalLM, Qwen3MoeForCausalLM; GGUF `qwen3`, `qwen3moe`) in PyTorch.

Built from the shared layers like the Llama family (kvserve.model.llama), with Qwen3's differences:

- q and k are RMS-normalized over each head (`q_norm`, `k_norm`, weights of head_dim) before RoPE;
- head_dim is its own number, not hidden / heads (Qwen3-0.6B: 16 heads of 128 in a hidden of 1024);
- no biases (Qwen2 had q/k/v biases);
- Qwen3-MoE: every layer's MLP is a mixture of experts (kvserve.model.moe): a softmax router, top-k,
  renormalised when `norm_topk_prob` (llama.cpp always renormalises a `qwen3moe` file).

One model class runs both: a config with experts gets the sparse MLP. Weights arrive with Hugging Face
names; the GGUF reader splits llama.cpp's stacked expert tensors (`ffn_*_exps`, one 3-D tensor per layer)
into the per-expert names through the `{expert}` in the names below.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import (GGUF, GGUF_PROJECTION_TENSORS, HF, Architecture, ModelFamily, gguf_config,
                                  hf_rope)
from kvserve.model.layers import GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding
from kvserve.model.moe import SparseMoE


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_for_layer(layer_index)
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens * self.num_heads, self.head_dim))  # new contiguous tensors
        k = self.k_norm(k.reshape(num_tokens * self.num_kv_heads, self.head_dim))
        ops.rope_(q.view(num_tokens, q_size), cos, sin, self.num_heads, self.head_dim)
        ops.rope_(k.view(num_tokens, kv_size), cos, sin, self.num_kv_heads, self.head_dim)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, layer_index)
        self.mlp = (SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, config.norm_topk_prob)
                    if config.num_experts else GatedMLP(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        """x, the residual stream, is updated in place (the model's own activations, nothing else's)."""
        normed = self.input_layernorm(x)
        normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn(normed, cos, sin, kv, layer))
        return x.add_(self.mlp(normed))


class Qwen3ForCausalLM(CausalLM):
    """Qwen3's decoder (dense, or with every MLP a mixture of experts), driven by CausalLM's forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_head()
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


# --- config.json -----------------------------------------------------------------------------------------

_MOE = "Qwen3MoeForCausalLM"


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Qwen3 (model_type qwen3) or Qwen3-MoE (qwen3_moe) config.json."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("Qwen3 with attention_bias=True is not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("Qwen3 with use_sliding_window=True is not supported")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = hf_rope(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 10000.0))
    moe: dict[str, Any] = {}
    if arch == _MOE:
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
            raise UnsupportedModelError(
                "Qwen3-MoE with dense layers (mlp_only_layers, or decoder_sparse_step other than 1) is not "
                "supported: every layer must be sparse")
        # transformers 5 writes `num_local_experts`; the Hub's config.json files `num_experts`.
        moe = dict(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                   num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **moe,
    )


# --- GGUF ----------------------------------------------------------------------------------------------


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """Qwen3's shape from llama.cpp's `qwen3.*` / `qwen3moe.*` metadata."""
    if arch != "qwen3moe":
        return gguf_config(meta, arch, vocab_rows)
    # A MoE file need not give a dense feed-forward length: none of its layers has one.
    config = gguf_config({f"{arch}.feed_forward_length": 0, **meta}, arch, vocab_rows)
    try:
        return replace(config, num_experts=int(meta[f"{arch}.expert_count"]),
                       num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
                       moe_intermediate_size=int(meta[f"{arch}.expert_feed_forward_length"]),
                       norm_topk_prob=True)  # llama.cpp's qwen3moe graph renormalises the top-k weights
    except KeyError as exc:
        raise ModelLoadError(f"GGUF metadata lacks {exc.args[0]}") from None


# `{expert}`: a stacked 3-D tensor in the file, one Hugging Face tensor per expert (kvserve.model.gguf).
GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}

FAMILY = ModelFamily(Qwen3ForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Qwen3ForCausalLM", HF, FAMILY),
    Architecture(_MOE, HF, FAMILY),
    Architecture("qwen3", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
    Architecture("qwen3moe", GGUF, FAMILY),
)
