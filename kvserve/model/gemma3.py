"""The Gemma 3 text decoder (Gemma3ForCausalLM; GGUF `gemma3`) in PyTorch.

Built from the shared layers like the Llama family (kvserve.model.llama), with
Gemma 3's differences:

- layers alternate between a sliding window and full attention (`layer_windows`;
  five local layers, then a global one), and the local layers rotate with their own
  RoPE base (`rope_local_theta`, 10,000) while the global ones use `rope_theta`
  (1,000,000) and any `rope_scaling`;
- q and k are RMS-normalized over head_dim before RoPE, and scores are scaled by
  query_pre_attn_scalar**-0.5;
- the embeddings are multiplied by sqrt(hidden_size);
- four norms per layer: the attention and MLP outputs are normalized before they join
  the residual stream, besides the usual pre-norms;
- a GELU (tanh) gated MLP; tied embeddings;
- every norm scales by (1 + w): the checkpoint's w is loaded with the 1 folded in.

Weights arrive with Hugging Face names (the GGUF reader renames and unshifts
llama.cpp's), so one `load_weights` serves both sources. How config.json and
llama.cpp's metadata describe Gemma 3, and llama.cpp's names for its tensors,
are here too, registered through kvserve.model.registry.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import UnsupportedModelError
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import (GGUF, GGUF_PROJECTION_TENSORS, HF, Architecture, ModelFamily, gguf_config,
                                  hf_rope)
from kvserve.model.layers import GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding

_NORM_OFFSET = 1.0  # Gemma's RMSNorm multiplies by (1 + w)


def _norm(size: int, config: ModelConfig) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, weight_offset=_NORM_OFFSET)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_for_layer(layer_index)  # this layer's attention kind
        # Windowed layers rotate with the local base (fixed here: a test may change the window, not the RoPE).
        self.local_rope = self.sliding_window is not None and config.rope_local_theta is not None
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size)
        self.q_norm = _norm(config.head_dim, config)
        self.k_norm = _norm(config.head_dim, config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # new contiguous tensors
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        ops.rope_(q.view(num_tokens, q_size), cos, sin, self.num_heads, self.head_dim)
        ops.rope_(k.view(num_tokens, kv_size), cos, sin, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(config.hidden_size, config)
        self.post_attention_layernorm = _norm(config.hidden_size, config)
        self.pre_feedforward_layernorm = _norm(config.hidden_size, config)
        self.post_feedforward_layernorm = _norm(config.hidden_size, config)
        self.self_attn = Gemma3Attention(config, layer_index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation=ops.GELU_TANH)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's decoder, driven by CausalLM's forward like every family."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # A Python float: multiplying an fp32 tensor by it rounds it to fp32, as transformers does when it
        # casts its scale to fp32 weights (in bf16 the scale itself would round: sqrt(640) -> 25.25).
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = _norm(config.hidden_size, config)
        self.build_head()
        # Global layers rotate with rope_theta and the scaling; windowed ones with their own base, unscaled.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary_emb = (RotaryEmbedding(config.head_dim, config.rope_local_theta)
                                 if any(layer.self_attn.local_rope for layer in self.layers) else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def rotary_for_layer(self, index: int) -> RotaryEmbedding:
        return self.local_rotary_emb if self.layers[index].self_attn.local_rope else self.rotary_emb

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tables = {id(rotary): rotary(positions) for rotary in (self.rotary_emb, self.local_rotary_emb)
                  if rotary is not None}
        return [tables[id(self.rotary_for_layer(index))] for index in range(len(self.layers))]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# --- config.json -----------------------------------------------------------------------------------------

# transformers' Gemma3TextConfig defaults, for the keys a config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Gemma3ForCausalLM config.json (model_type gemma3_text)."""
    cfg = {**_HF_DEFAULTS, **{key: value for key, value in cfg.items() if value is not None}}
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=True (an embedding model) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg["sliding_window_pattern"])
    layer_types = cfg.get("layer_types") or [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 layer types {unknown} are not supported; supported: {_SLIDING}, {_FULL}")
    window = int(cfg["sliding_window"])
    # transformers >= 5 writes one `rope_parameters` set per layer type; older config.json files give the
    # global layers `rope_theta` + `rope_scaling` and the local ones `rope_local_base_freq`.
    params = cfg.get("rope_parameters") or {}
    if _FULL in params or _SLIDING in params:
        full, local = params.get(_FULL) or {}, params.get(_SLIDING) or {}
    else:
        full, local = cfg.get("rope_scaling") or {}, {"rope_theta": cfg["rope_local_base_freq"]}
    theta, scaling = hf_rope(full, cfg["rope_theta"])
    local_theta, local_scaling = hf_rope(local, cfg["rope_local_base_freq"])
    if local_scaling != RopeScaling():
        raise UnsupportedModelError(f"RoPE scaling on the sliding-window layers ({local_scaling.rope_type}) "
                                    "is not supported")
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg["head_dim"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        sliding_window=window,
        layer_windows=tuple(window if kind == _SLIDING else None for kind in layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=int(cfg["query_pre_attn_scalar"]),
        final_logit_softcapping=float(softcap) if softcap else None,
    )


# --- GGUF ----------------------------------------------------------------------------------------------

# Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3): the file gives the window but not which
# layers use it, nor their RoPE base, nor the attention scale.
GGUF_WINDOW_PATTERN = 6  # five sliding-window layers, then one global
GGUF_LOCAL_ROPE_THETA = 10_000.0
_27B_LAYERS = 62  # the one size whose query_pre_attn_scalar is hidden / heads rather than head_dim


def gguf_layer_windows(window: int | None, num_layers: int) -> tuple[int | None, ...]:
    """Which layers use the window, as llama.cpp decides for a Gemma 3 file: five of every six (None: none)."""
    return tuple(window if window and (i + 1) % GGUF_WINDOW_PATTERN else None for i in range(num_layers))


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """Gemma 3's shape from llama.cpp's `gemma3.*` metadata and its rules for what the file leaves out."""
    config = gguf_config(meta, arch, vocab_rows)
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)  # absent or 0: every layer global
    softcap = meta.get(f"{arch}.final_logit_softcapping")
    num_layers = config.num_layers
    return replace(
        config,
        sliding_window=window or None,
        layer_windows=gguf_layer_windows(window or None, num_layers),
        rope_local_theta=GGUF_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=(config.hidden_size // config.num_heads if num_layers == _27B_LAYERS
                               else config.head_dim),
        final_logit_softcapping=float(softcap) if softcap else None,
    )


# llama.cpp names Gemma 3's four norms after what they follow: `ffn_norm` is the pre-feedforward
# norm there (Llama's post-attention norm), `post_attention_norm` the norm of the attention output.
GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

FAMILY = ModelFamily(
    Gemma3ForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS,
    refused={"Gemma3ForConditionalGeneration": (
        "Gemma3ForConditionalGeneration (the multimodal Gemma 3 checkpoints) is not supported: load a text-only "
        "checkpoint (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b) or a Gemma 3 GGUF file")},
)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Gemma3ForCausalLM", HF, FAMILY),
    # llama.cpp stores the (1 + w) norms as 1 + w: the reader takes the 1 off again. NEOX RoPE: unpermuted.
    Architecture("gemma3", GGUF, FAMILY, gguf_norm_shift=1.0),
)
