"""OLMo 2 (Olmo2ForCausalLM; GGUF `olmo2`) in PyTorch.

Where it differs from the Llama family (kvserve.model.llama):

- norms after the attention and after the MLP, not before: x + norm(attn(x)), then h + norm(mlp(h)) (no
  input norms; the final norm as usual);
- q and k are RMS-normalized over the whole projection (all heads at once: one weight of num_heads *
  head_dim), before RoPE.

llama.cpp names the two layer norms `post_attention_norm` and `post_ffw_norm`, q/k's `attn_q_norm` and
`attn_k_norm`, and stores Q/K unpermuted (NEOX RoPE).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedModelError
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.model import llama
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import GGUF, GGUF_PROJECTION_TENSORS, HF, Architecture, ModelFamily, gguf_config
from kvserve.model.layers import GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding


class Olmo2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_for_layer(layer_index)
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size)
        self.q_norm = RMSNorm(config.num_heads * config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.num_kv_heads * config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q)  # new contiguous tensors, rotated in place below
        k = self.k_norm(k)
        ops.rope_(q, cos, sin, self.num_heads, self.head_dim)
        ops.rope_(k, cos, sin, self.num_kv_heads, self.head_dim)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Olmo2Attention(config, layer_index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, kv, layer))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2's decoder, driven by CausalLM's forward like every family."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_head()
        self.rotary_emb = RotaryEmbedding.of(config)


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """An Olmo2ForCausalLM config.json (model_type olmo2): Llama's fields."""
    if cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError("clip_qkv is not supported")
    return llama.read_hf_config(cfg, arch)


GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

FAMILY = ModelFamily(Olmo2ForCausalLM, read_hf_config, gguf_config, GGUF_LAYER_TENSORS)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Olmo2ForCausalLM", HF, FAMILY),
    Architecture("olmo2", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
)
