"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in PyTorch, and how its sources describe it.

Built from the shared layers (kvserve.model.layers), driven by CausalLM's
forward. Its config.json reading (Qwen2's biases and opt-in window,
Mistral's window) and llama.cpp's tensor names live here too, registered
through kvserve.model.registry. Weights arrive with
Hugging Face names and are streamed into the parameters by `load_weights`;
Q/K/V and gate/up are fused into one matmul each (fewer, larger GEMMs: the
decode step is dominated by per-call overhead at small batch), each
checkpoint tensor written into its rows of the fused weight. Attention
reaches the KV cache only through the forward's `AttentionContext.attend`
(kvserve.kv.attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedModelError
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.model import decoder_stack
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import (GGUF, GGUF_PROJECTION_TENSORS, HF, Architecture, ModelFamily, gguf_config,
                                  hf_rope)
from kvserve.model.layers import GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_for_layer(layer_index)  # this layer's attention kind
        self.rotates = config.rope_layers is None or config.rope_layers[layer_index]  # SmolLM3: some do not
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        if self.rotates:
            ops.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)  # Q and K, in place
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        """x, the residual stream, is updated in place (the model's own activations, nothing else's)."""
        normed = self.input_layernorm(x)
        normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn(normed, cos, sin, kv, layer))
        return x.add_(self.mlp(normed))


class LlamaForCausalLM(CausalLM):
    """The Llama family's decoder: pre-norm layers, one RoPE for every layer, SiLU gated MLP."""

    decoder_layer: type[nn.Module] = DecoderLayer  # a family built on Llama's may scale its branches (Granite)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_head()
        self.rotary_emb = RotaryEmbedding.of(config)

    def extra_checkpoint_tensors(self) -> dict[str, Callable[[torch.Tensor], None]]:
        return {"rope_freqs": self.rotary_emb.load_freq_divisors}  # GGUF: Llama 3.1-style scaling as divisors

    def run_layers_at_once(self, x: torch.Tensor, positions: torch.Tensor, kv: AttentionContext) -> bool:
        if not decoder_stack.ENABLED:
            return False
        step = kv.plain_paged_step()
        if step is None or len(step.k_caches) != len(self.layers):
            return False
        if "_decoder_stack" not in self.__dict__:  # built once, on the first step that can use it
            self.__dict__["_decoder_stack"] = self._build_decoder_stack()
        stack = self.__dict__["_decoder_stack"]
        if stack is None:
            return False
        cos, sin = self.rotary_emb(positions)
        decoder_stack.run_stack(stack, x, cos, sin, step, self.config.attention_scale)
        return True

    def decoder_stack(self) -> object | None:
        """None also before the first step that could build it, or where these layers cannot be one."""
        return self.__dict__.get("_decoder_stack")

    def _build_decoder_stack(self) -> object | None:
        """The stack of these layers if they are plain Llama layers (a family built on them that changes a
        layer, its RoPE per layer or rotates part of a head keeps its own forward), else None."""
        config = self.config
        plain = (type(self).rope_tables is CausalLM.rope_tables and self.rotary_emb.head_dim == config.head_dim
                 and all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                         and type(layer.mlp) is GatedMLP and layer.self_attn.rotates
                         and layer.self_attn.scale == config.attention_scale
                         and isinstance(layer.mlp.activation, int) for layer in self.layers))
        if not plain:
            return None
        return decoder_stack.build_decoder_stack(self.layers, config.num_heads, config.num_kv_heads, config.head_dim,
                                                 config.rms_norm_eps)


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Llama / Mistral / Qwen2 config.json."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    # transformers >= 5 writes `rope_parameters` (theta included); older
    # checkpoints write `rope_theta` + `rope_scaling`. Accept both.
    theta, scaling = hf_rope(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 10000.0),
                             cfg.get("max_position_embeddings"))
    if arch == "Qwen2ForCausalLM":
        attention_bias = True
        # Qwen2 declares a window but applies it only when use_sliding_window is set.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    else:
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=attention_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None,
    )


GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}

FAMILY = ModelFamily(LlamaForCausalLM, read_hf_config, gguf_config, GGUF_LAYER_TENSORS)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", HF, FAMILY),
    Architecture("MistralForCausalLM", HF, FAMILY),
    Architecture("Qwen2ForCausalLM", HF, FAMILY),
    Architecture("llama", GGUF, FAMILY, gguf_permuted_qk=True),
    Architecture("qwen2", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
)
