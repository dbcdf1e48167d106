"""Qwen3.5 text models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; GGUF `qwen35`, `qwen35moe`) in PyTorch: a
hybrid of Gated DeltaNet layers and full attention (three linear_attention layers, then one full_attention,
by default).

- Linear-attention layers: kvserve.model.gated_deltanet (a recurrent state per request, no K/V).
- Full-attention layers: Qwen3's (q/k RMS-normalised over each head, GQA) with an output gate (q_proj yields,
  per head, head_dim query channels then head_dim gate channels; the attention output is multiplied by
  sigmoid(gate) before o_proj) and partial RoPE (the first head_dim * partial_rotary_factor channels; 1/4).
- Every RMSNorm but the DeltaNet's gated one scales by (1 + w) (Hugging Face stores w; llama.cpp 1 + w).
- RoPE: transformers runs Qwen3.5's multimodal RoPE (mrope_section: the rotated frequencies split between
  temporal, height and width positions); for text the three positions are the token's position, so it is
  plain 1-D RoPE, which is what runs here (positions are 1-D; images are not supported).

The GGUF reader undoes what llama.cpp's converter did (convert_hf_to_gguf.py, Qwen3NextModel and
_LinearAttentionVReorderBase): A_log stored as -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the conv
weight squeezed to [channels, kernel], 1 added to the (1 + w) norms; its reordering of value heads (tiled, not
grouped by key head) is kept, and the layer reads it so (GatedDeltaNetShape.value_heads_tiled).

The Hub's checkpoints are Qwen3_5ForConditionalGeneration: their language model loads and runs on text (token
ids) alone. Not supported: images and video, the multi-token-prediction layers (mtp.*, GGUF `nextn`).

Qwen3.5-MoE (Qwen3_5MoeForCausalLM; GGUF `qwen35moe`): every layer's MLP is routed experts (softmax, top-k
renormalised) plus a shared expert weighted by sigmoid(shared_expert_gate(x)) (kvserve.model.moe.SharedExpertMoE).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kvserve.config import ATTENTION, RECURRENT, GatedDeltaNetShape, ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.kv.state.context import StateContext
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import (GGUF, GGUF_PROJECTION_TENSORS, HF, Architecture, ModelFamily, gguf_config,
                                  hf_rope)
from kvserve.model.gated_deltanet import GatedDeltaNet
from kvserve.model.layers import GatedMLP, Linear, MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding, per_row
from kvserve.model.moe import SharedExpertMoE

# (1 + w) norms: the weight as loaded is offset by 1 (kvserve.model.layers.RMSNorm), then runs like any other.
_NORM_OFFSET = 1.0


class GatedQKVLinear(QKVLinear):
    """Q (with its output gate: 2 x head_dim rows per head), K and V in one GEMM; shards "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
        kv_size = num_kv_heads * head_dim
        MergedLinear.__init__(self, hidden_size, [2 * num_heads * head_dim, kv_size, kv_size])


class Qwen35Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = None
        self.qkv_proj = GatedQKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, _NORM_OFFSET)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, _NORM_OFFSET)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        """`layer`: the attention layer's index in the KV cache (not its model layer)."""
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_and_gate, k, v = self.qkv_proj(x).split([2 * heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q_and_gate = q_and_gate.view(num_tokens, heads, 2 * dim)
        gate = q_and_gate[..., dim:].reshape(num_tokens, heads * dim)
        q = self.q_norm(q_and_gate[..., :dim].reshape(num_tokens * heads, dim))  # new contiguous tensors
        k = self.k_norm(k.reshape(num_tokens * kv_heads, dim))
        ops.rope_(q.view(num_tokens, heads * dim), cos, sin, heads, dim)
        ops.rope_(k.view(num_tokens, kv_heads * dim), cos, sin, kv_heads, dim)
        out = kv.attend(layer, q.view(num_tokens, heads, dim), k.view(num_tokens, kv_heads, dim),
                        v.reshape(num_tokens, kv_heads, dim), self.scale)
        return self.o_proj(out.reshape(num_tokens, heads * dim) * per_row(torch.sigmoid, gate))


class Qwen35DecoderLayer(nn.Module):
    """A full-attention layer (`self_attn`) or a Gated DeltaNet one (`linear_attn`), then the MLP."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        if config.layer_kinds is None or config.gated_deltanet is None:
            raise ModelLoadError("a Qwen3.5 config names its layer kinds and its Gated DeltaNet shape")
        self.attends = config.layer_kinds[layer_index] == ATTENTION
        if self.attends:
            self.self_attn = Qwen35Attention(config)
            self.cache_layer = config.attention_layers.index(layer_index)  # its layer in the KV cache
        else:
            self.linear_attn = GatedDeltaNet(config.gated_deltanet, config.hidden_size, config.rms_norm_eps)
            self.cache_layer = config.recurrent_layers.index(layer_index)  # its layer in the state cache
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, _NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, _NORM_OFFSET)
        self.mlp = (SharedExpertMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                    config.num_experts_per_tok, config.norm_topk_prob,
                                    config.shared_expert_intermediate_size)
                    if config.num_experts else GatedMLP(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int, states: StateContext) -> torch.Tensor:
        """x, the residual stream, is updated in place (the model's own activations, nothing else's)."""
        normed = self.input_layernorm(x)
        if self.attends:
            mixed = self.self_attn(normed, cos, sin, kv, self.cache_layer)
        else:
            mixed = self.linear_attn(normed, states, self.cache_layer)
        normed = self.post_attention_layernorm.add_and_norm(x, mixed)
        return x.add_(self.mlp(normed))


class Qwen35ForCausalLM(CausalLM):
    """Qwen3.5's hybrid decoder, driven by CausalLM's forward (with the step's recurrent-state context)."""

    stacked_params = CausalLM.stacked_params + (
        ("in_proj", "in_proj_qkv", 0), ("in_proj", "in_proj_z", 1), ("in_proj", "in_proj_b", 2),
        ("in_proj", "in_proj_a", 3),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, _NORM_OFFSET)
        self.build_head()
        self.rotary_emb = RotaryEmbedding.of(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A text-only checkpoint's names, or a Qwen3_5ForConditionalGeneration's (the Hub's Qwen3.5 files): its
        language model's tensors under `model.language_model.`; its vision tower (`model.visual.`) and its
        multi-token-prediction layers (`mtp.`) are not run, so not loaded."""
        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace("model.language_model.", "model.", 1)
                if not name.startswith(_NOT_RUN) and not self._beyond_the_layers(name):
                    yield name, tensor

        super().load_weights(text_weights())

    def _beyond_the_layers(self, name: str) -> bool:
        """A GGUF file's multi-token-prediction blocks (`blk.N.nextn.*` and their attention and MLP) come after
        the decoder's layers, as layers of their own."""
        parts = name.split(".", 3)
        return parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_layers


# --- config.json -----------------------------------------------------------------------------------------

_LAYER_KINDS = {"linear_attention": RECURRENT, "full_attention": ATTENTION}
_CONDITIONAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
_NOT_RUN = ("model.visual.", "mtp.")  # a checkpoint's vision tower and multi-token-prediction layers


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM config.json (model_type qwen3_5_text / qwen3_5_moe_text), or
    a ...ForConditionalGeneration's (model_type qwen3_5 / qwen3_5_moe): its `text_config`, run as text only."""
    if arch in _CONDITIONAL:
        if not isinstance(cfg.get("text_config"), dict):
            raise ModelLoadError(f"a {arch} config.json without its text_config")
        # transformers ties the head by the outer config's flag, not the text config's
        return _read_text_config({**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)},
                                 arch)
    return _read_text_config(cfg, arch)


def _read_text_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("Qwen3.5 with attention_bias=True is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or _interval_types(int(cfg.get("full_attention_interval", 4)), num_layers)
    unknown = set(layer_types) - set(_LAYER_KINDS)
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(f"Qwen3.5 layer_types must be {num_layers} of {sorted(_LAYER_KINDS)}, got "
                                    f"{layer_types}")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta, scaling = hf_rope(params, cfg.get("rope_theta", 10000.0))
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))))
    shape = GatedDeltaNetShape(
        num_key_heads=int(cfg["linear_num_key_heads"]), num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]), value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
    moe: dict[str, Any] = {}
    if arch in _MOE:  # every layer sparse; transformers always renormalises the top-k weights
        moe = dict(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True,
                   shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        layer_kinds=tuple(_LAYER_KINDS[kind] for kind in layer_types),
        recurrent_state=shape.state_shapes,
        gated_deltanet=shape,
        **moe,
    )


def _interval_types(interval: int, num_layers: int) -> list[str]:
    """Every `interval`-th layer full attention, the others linear (transformers' and llama.cpp's default)."""
    if interval < 1:
        raise UnsupportedModelError(f"full_attention_interval must be positive, got {interval}")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


# --- GGUF ----------------------------------------------------------------------------------------------


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """Qwen3.5's shape from llama.cpp's `qwen35.*` / `qwen35moe.*` metadata (its ssm.* keys name the DeltaNet's
    shape; a MoE file's expert_* keys its experts, whose top-k weights llama.cpp always renormalises)."""
    moe = arch == "qwen35moe"
    # A MoE file need not give a dense feed-forward length: none of its layers has one.
    config = gguf_config({f"{arch}.feed_forward_length": 0, **meta} if moe else meta, arch, vocab_rows)
    # The converter counts the multi-token-prediction blocks (not run here) among the blocks, after the layers.
    prediction_blocks = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    if not 0 <= prediction_blocks < config.num_layers:
        raise ModelLoadError(f"{arch}.nextn_predict_layers ({prediction_blocks}) leaves no decoder layers")
    config = replace(config, num_layers=config.num_layers - prediction_blocks)

    def get(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return int(meta[f"{arch}.{key}"])

    value_heads = get("ssm.time_step_rank")
    inner = get("ssm.inner_size")
    if inner % value_heads:
        raise ModelLoadError(f"{arch}.ssm.inner_size ({inner}) is not a multiple of the value heads ({value_heads})")
    shape = GatedDeltaNetShape(num_key_heads=get("ssm.group_count"), num_value_heads=value_heads,
                               key_head_dim=get("ssm.state_size"), value_head_dim=inner // value_heads,
                               conv_kernel=get("ssm.conv_kernel"), value_heads_tiled=True)
    interval = int(meta.get(f"{arch}.full_attention_interval", 4))
    kinds = tuple(_LAYER_KINDS[kind] for kind in _interval_types(interval, config.num_layers))
    experts = {}
    if moe:
        experts = dict(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                       moe_intermediate_size=get("expert_feed_forward_length"), norm_topk_prob=True,
                       shared_expert_intermediate_size=get("expert_shared_feed_forward_length"))
    return replace(config, layer_kinds=kinds, recurrent_state=shape.state_shapes, gated_deltanet=shape, **experts)


GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    # qwen35moe: the router, the stacked routed experts (`{expert}`: kvserve.model.gguf), the shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    # the multi-token-prediction blocks' own tensors (blocks past the layers: read, not loaded)
    **{f"nextn.{name}.weight": f"mtp.{name}.weight"
       for name in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")},
}


def undo_gguf_conversion(hf_name: str, value: torch.Tensor) -> torch.Tensor:
    """A GGUF file's tensor as Hugging Face holds it: what convert_hf_to_gguf.py did to it, undone."""
    if hf_name.endswith(".linear_attn.A_log"):
        return torch.log(-value)  # stored as A = -exp(A_log)
    if hf_name.endswith(".mlp.shared_expert_gate.weight"):
        return value.reshape(1, -1)  # one output; a file may hold it as a vector
    if hf_name.endswith(".linear_attn.conv1d.weight"):
        return value.unsqueeze(1) if value.dim() == 2 else value  # squeezed from [channels, 1, kernel]
    if hf_name.endswith("norm.weight") and not hf_name.endswith(".linear_attn.norm.weight"):
        return value - _NORM_OFFSET  # the (1 + w) norms, stored as 1 + w
    return value


FAMILY = ModelFamily(Qwen35ForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS,
                     gguf_tensor_fix=undo_gguf_conversion)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Qwen3_5ForCausalLM", HF, FAMILY),
    Architecture("Qwen3_5MoeForCausalLM", HF, FAMILY),
    *(Architecture(name, HF, FAMILY) for name in _CONDITIONAL),  # the language model alone: no images or video
    Architecture("qwen35", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
    Architecture("qwen35moe", GGUF, FAMILY),
)
