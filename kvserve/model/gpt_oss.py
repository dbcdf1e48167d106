"""gpt-oss (GptOssForCausalLM; GGUF `gpt-oss`) in PyTorch.

Built from the shared layers and Qwen3-MoE's mixture of experts (kvserve.model.moe), with gpt-oss's
differences:

- attention sinks: each head has a learned logit in its softmax denominator (`self_attn.sinks`), passed to
  the attention context, which every path of the cpu backend takes (kv/attention/reference.py);
- layers alternate between a sliding window (128) and full attention (`layer_types`), one window per layer
  as Gemma 3 does (`layer_windows`);
- biases on q/k/v, o, the router and every expert projection;
- the router takes the top k logits first, then a softmax over those k alone;
- the experts' activation is a clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit],
  (up + 1) * gate * sigmoid(alpha * gate);
- YaRN RoPE (factor 32 over 4,096 positions), the correction band not rounded (`truncate: false`).

Hugging Face stores each layer's experts stacked, gate and up interleaved column by column
(`mlp.experts.gate_up_proj` `[E, hidden, 2I]`, transposed); `load_weights` splits them into the per-expert
names Qwen3-MoE uses, and llama.cpp's stacked `ffn_*_exps` tensors (and their biases) split the same way in
the GGUF reader. The Hub's own checkpoint holds its experts in MXFP4 blocks (`*_blocks` / `*_scales`): refused
here (its GGUF file, whose MXFP4 experts are dequantized at load, or a dequantized checkpoint loads).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import GGUF, GGUF_PROJECTION_TENSORS, HF, Architecture, ModelFamily, gguf_config, hf_rope
from kvserve.model.layers import Linear, QKVLinear, RMSNorm, RotaryEmbedding, new_parameter
from kvserve.model.moe import SparseMoE

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def clamped_swiglu(gate_up: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's expert activation of `[N, 2I]` (gate columns, then up) -> `[N, I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_for_layer(layer_index)
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_bias)
        self.sinks = new_parameter(config.num_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        ops.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)  # Q and K, in place
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale, self.sinks))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, layer_index)
        self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                             config.num_experts_per_tok, norm_topk_prob=False, softmax_over_top_k=True, bias=True,
                             activation=functools.partial(clamped_swiglu, alpha=alpha, limit=limit))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        """x, the residual stream, is updated in place (the model's own activations, nothing else's)."""
        normed = self.input_layernorm(x)
        normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn(normed, cos, sin, kv, layer))
        return x.add_(self.mlp(normed))


class GptOssForCausalLM(CausalLM):
    """gpt-oss's decoder, driven by CausalLM's forward like every family."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i, SWIGLU_ALPHA, SWIGLU_LIMIT)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_head()
        self.rotary_emb = RotaryEmbedding.of(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert_weights(weights))


def per_expert_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face's stacked experts as one tensor per expert and projection (the names SparseMoE loads), the
    router as SparseMoE's `gate`; every other tensor as it comes (a GGUF file's arrive per expert already)."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".mlp.experts.")
        if name.endswith(("_blocks", "_scales")) and ".mlp.experts." in name:
            raise UnsupportedModelError(
                f"{name}: gpt-oss experts held as MXFP4 blocks in a safetensors checkpoint are not supported; load "
                "the model's GGUF file, or a checkpoint with the experts dequantized (bf16 or fp32)")
        if not prefix or "." in leaf:  # not an expert tensor, or one expert's already (a GGUF file's)
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        experts = f"{prefix}.mlp.experts"
        for e, expert in enumerate(tensor):
            if leaf == "gate_up_proj":  # [hidden, 2I], gate and up interleaved by column
                yield f"{experts}.{e}.gate_proj.weight", expert[:, ::2].t()
                yield f"{experts}.{e}.up_proj.weight", expert[:, 1::2].t()
            elif leaf == "gate_up_proj_bias":
                yield f"{experts}.{e}.gate_proj.bias", expert[::2]
                yield f"{experts}.{e}.up_proj.bias", expert[1::2]
            elif leaf == "down_proj":  # [I, hidden]
                yield f"{experts}.{e}.down_proj.weight", expert.t()
            elif leaf == "down_proj_bias":
                yield f"{experts}.{e}.down_proj.bias", expert
            else:
                raise ModelLoadError(f"unexpected gpt-oss expert tensor {name}")


# --- config.json -----------------------------------------------------------------------------------------

_SLIDING, _FULL = "sliding_attention", "full_attention"


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A GptOssForCausalLM config.json (model_type gpt_oss)."""
    alpha, limit = float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)), float(cfg.get("swiglu_limit", SWIGLU_LIMIT))
    if (alpha, limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
        raise UnsupportedModelError(f"gpt-oss SwiGLU alpha {alpha} / limit {limit} are not supported "
                                    f"(only {SWIGLU_ALPHA} / {SWIGLU_LIMIT})")
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [_SLIDING if i % 2 == 0 else _FULL for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
    if unknown:
        raise UnsupportedModelError(f"gpt-oss layer types {unknown} are not supported; supported: {_SLIDING}, {_FULL}")
    window = int(cfg.get("sliding_window") or 128)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    max_positions = int(cfg.get("max_position_embeddings", 131072))
    theta, scaling = hf_rope(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {},
                             cfg.get("rope_theta", 150000.0), max_positions)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=0,  # no dense MLP: every layer's is the experts'
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=max_positions,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=window,
        layer_windows=tuple(window if kind == _SLIDING else None for kind in layer_types),
        num_experts=int(cfg["num_local_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size"]),
    )


# --- GGUF ----------------------------------------------------------------------------------------------


def gguf_layer_windows(window: int, num_layers: int) -> tuple[int | None, ...]:
    """llama.cpp's gpt-oss layers: a sliding window on every even layer, full attention on the odd ones."""
    return tuple(window if i % 2 == 0 else None for i in range(num_layers))


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """gpt-oss's shape from llama.cpp's `gpt-oss.*` metadata."""
    config = gguf_config({f"{arch}.feed_forward_length": 0, **meta}, arch, vocab_rows)
    try:
        window = int(meta[f"{arch}.attention.sliding_window"])
        moe = dict(num_experts=int(meta[f"{arch}.expert_count"]),
                   num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
                   moe_intermediate_size=int(meta[f"{arch}.expert_feed_forward_length"]))
    except KeyError as exc:
        raise ModelLoadError(f"GGUF metadata lacks {exc.args[0]}") from None
    scaling = config.rope_scaling
    if scaling.rope_type == "yarn":  # gpt-oss's YaRN band is not rounded to whole dimensions (its config.json)
        scaling = replace(scaling, truncate=False)
    return replace(config, intermediate_size=0, sliding_window=window,
                   layer_windows=gguf_layer_windows(window, config.num_layers), rope_scaling=scaling, **moe)


# llama.cpp's gpt-oss names: `post_attention_norm` is the norm before the experts (Llama's ffn_norm).
GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    **{f"attn_{part}.bias": f"self_attn.{part}_proj.bias" for part in ("q", "k", "v")},
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    **{f"ffn_{part}_exps.{kind}": f"mlp.experts.{{expert}}.{part}_proj.{kind}"
       for part in ("gate", "up", "down") for kind in ("weight", "bias")},
}

FAMILY = ModelFamily(GptOssForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("GptOssForCausalLM", HF, FAMILY),
    Architecture("gpt-oss", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
)
