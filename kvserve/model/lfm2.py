"""LFM2 (Lfm2ForCausalLM; GGUF `lfm2`): Liquid AI's hybrid of short convolutions and attention, in PyTorch.

Each layer is pre-norm (`operator_norm`, then `ffn_norm` before a SwiGLU MLP) around one operator:

- "conv" layers: the double-gated short convolution (kvserve.model.short_conv), a recurrent layer whose
  per-request state is its convolution window, `[hidden, conv_L_cache - 1]`;
- "full_attention" layers: GQA with q and k RMS-normalized per head before RoPE (NEOX), as Qwen3's attention
  (reused: only the checkpoint names differ, `out_proj`, `q_layernorm`, `k_layernorm`).

The norm transformers calls `embedding_norm` is the FINAL norm (applied after the last layer); llama.cpp
names it `token_embd_norm`. The MLP's width is derived from config.json's `block_*` fields (`mlp_width`);
llama.cpp's converter writes the derived width. A GGUF file gives the layer kinds as a per-layer
`head_count_kv` array, 0 for a convolution layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kvserve.config import ATTENTION, RECURRENT, ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kv.attention import AttentionContext
from kvserve.kv.state.context import StateContext
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily, gguf_config, hf_rope
from kvserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from kvserve.model.qwen3 import Qwen3Attention
from kvserve.model.short_conv import ShortConv


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attends = config.layer_kinds is None or config.layer_kinds[layer_index] == ATTENTION
        if self.attends:
            self.self_attn = Qwen3Attention(config, layer_index)
            self.attention_layer = config.attention_layers.index(layer_index)
        else:
            kernel = config.recurrent_state[0][1] + 1  # the window keeps all but the newest input
            self.conv = ShortConv(config.hidden_size, kernel, config.conv_bias,
                                  config.recurrent_layers.index(layer_index))
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int, states: StateContext | None = None) -> torch.Tensor:
        """x, the residual stream, is updated in place (the model's own activations, nothing else's)."""
        normed = self.operator_norm(x)
        if self.attends:
            mixed = self.self_attn(normed, cos, sin, kv, self.attention_layer)
        else:
            if states is None:
                raise ValueError("a convolution layer needs the step's recurrent-state context")
            mixed = self.conv(normed, states)
        normed = self.ffn_norm.add_and_norm(x, mixed)
        return x.add_(self.feed_forward(normed))


class Lfm2ForCausalLM(CausalLM):
    """LFM2's decoder, driven by CausalLM's forward (which passes the recurrent-state context)."""

    # Our fused Q/K/V, then what transformers names otherwise (shard None: the whole parameter).
    stacked_params = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("o_proj", "out_proj", None), ("q_norm", "q_layernorm", None), ("k_norm", "k_layernorm", None),
        ("gate_up_proj", "w1", 0), ("gate_up_proj", "w3", 1), ("down_proj", "w2", None),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(config, i) for i in range(config.num_layers))
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # the final norm (see above)
        self.build_head()
        self.rotary_emb = RotaryEmbedding.of(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embedding_norm(hidden))


# --- config.json -----------------------------------------------------------------------------------------


def mlp_width(cfg: dict[str, Any]) -> int:
    """The MLP's intermediate width as transformers' Lfm2MLP derives it: `block_ff_dim` (else
    intermediate_size), by default cut to 2/3, times `block_ffn_dim_multiplier` and rounded up to
    `block_multiple_of` (only when a multiplier is given)."""
    width = int(cfg.get("block_ff_dim") or cfg.get("intermediate_size") or 12288)
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    multiple = int(cfg.get("block_multiple_of", 256))
    width = int(multiplier * width)
    return multiple * ((width + multiple - 1) // multiple)


def _layer_kinds(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:  # older config.json files list the attention layers; none listed: all attend
        attention = cfg.get("full_attn_idxs")
        attention = range(num_layers) if attention is None else attention
        types = ["full_attention" if i in attention else "conv" for i in range(num_layers)]
    unknown = sorted(set(types) - {"conv", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"LFM2 layer types {unknown} are not supported (only conv, full_attention)")
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(RECURRENT if kind == "conv" else ATTENTION for kind in types)


def _conv_state(hidden: int, kernel: int) -> tuple[tuple[int, ...], ...]:
    if kernel < 2:
        raise UnsupportedModelError(f"a short-convolution kernel of {kernel} is not supported (at least 2)")
    return ((hidden, kernel - 1),)


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """An LFM2 config.json (model_type lfm2)."""
    num_layers = int(cfg["num_hidden_layers"])
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = hf_rope(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {},
                             cfg.get("rope_theta", 1000000.0))
    # transformers reads an older `tie_embedding` over tie_word_embeddings.
    tied = cfg["tie_embedding"] if "tie_embedding" in cfg else cfg.get("tie_word_embeddings", True)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=mlp_width(cfg),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128000)),
        rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(tied),
        layer_kinds=_layer_kinds(cfg, num_layers),
        recurrent_state=_conv_state(hidden, int(cfg.get("conv_L_cache", 3))),
        conv_bias=bool(cfg.get("conv_bias", False)),
    )


# --- GGUF ----------------------------------------------------------------------------------------------


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """LFM2's shape from llama.cpp's `lfm2.*` metadata: `attention.head_count_kv` per layer (0: a
    convolution layer), `shortconv.l_cache` the kernel, the MLP width as derived already."""
    if meta.get(f"{arch}.attention.sliding_window"):
        raise UnsupportedModelError("LFM2 with sliding-window attention is not supported")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv")
    per_layer = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else None
    attending = sorted({int(n) for n in per_layer or () if n})
    if per_layer is not None and len(attending) > 1:
        raise UnsupportedModelError(f"attention layers with different KV head counts {attending} are not supported")
    single = {f"{arch}.attention.head_count_kv": attending[0]} if attending else {}
    config = gguf_config({**meta, **single}, arch, vocab_rows)
    if per_layer is not None and len(per_layer) != config.num_layers:
        raise ModelLoadError(f"GGUF head_count_kv has {len(per_layer)} entries for {config.num_layers} layers")
    kinds = (tuple(ATTENTION if n else RECURRENT for n in per_layer) if per_layer is not None
             else (ATTENTION,) * config.num_layers)
    kernel = meta.get(f"{arch}.shortconv.l_cache")
    if kernel is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.shortconv.l_cache")
    return replace(config, layer_kinds=kinds, recurrent_state=_conv_state(config.hidden_size, int(kernel)))


GGUF_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "operator_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "shortconv.conv.weight": "conv.conv.weight",  # 2-D: the converter squeezes nn.Conv1d's [hidden, 1, L]
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
}

FAMILY = ModelFamily(Lfm2ForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS,
                     gguf_global_tensors={"token_embd_norm.weight": "model.embedding_norm.weight"})
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Lfm2ForCausalLM", HF, FAMILY),
    Architecture("lfm2", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
)
