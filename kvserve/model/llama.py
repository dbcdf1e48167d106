"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in PyTorch.

Weights arrive with Hugging Face names; Q/K/V and gate/up are fused into one
matmul each at load time (fewer, larger GEMMs: the decode step is dominated by
per-call overhead at small batch). Attention reaches the KV cache only through
the forward's `AttentionContext.attend` (kvserve.kv.attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.kv.attention import AttentionContext, ContiguousContext


def rope_inv_freq(config: ModelConfig, freq_divisors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies `[head_dim / 2]` with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if freq_divisors is not None:  # GGUF `rope_freqs`: llama.cpp's precomputed scaling
        return inv_freq / freq_divisors
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # the band between interpolated smoothly.
        old_context = scaling.original_max_position_embeddings
        low_freq_wavelen = old_context / scaling.low_freq_factor
        high_freq_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, 1, D]` (rotate-half layout, as in Hugging Face)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.window_for_layer(layer_index)  # this layer's attention kind
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: AttentionContext,
        layer: int,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)

    def forward(self, x, positions, cos, sin, kv, layer) -> torch.Tensor:
        normed = F.rms_norm(x, x.shape[-1:], self.input_layernorm, self.eps)
        x = x + self.self_attn(normed, positions, cos, sin, kv, layer)
        normed = F.rms_norm(x, x.shape[-1:], self.post_attention_layernorm, self.eps)
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer.

    `forward(input_ids, positions, kv)` runs a step's N new tokens (of one or
    many requests) at `positions`; `kv`, the step's attention context (from the
    engine's attention backend), stores their K/V and attends over what each
    request has cached. With `kv=None` the tokens must be one whole sequence,
    attended over by the contiguous context (nothing stored).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor]) -> "LlamaForCausalLM":
        """Build the model around Hugging Face-named fp32 weights (consumed, not copied).

        The module is created on the meta device and the weights are assigned
        in, so loading allocates no second copy of the model.
        """
        with torch.device("meta"):
            model = cls(config)
        state = model._fuse_hf_weights(weights)
        model.load_state_dict(state, assign=True, strict=True)
        model.inv_freq = rope_inv_freq(config, weights.get("rope_freqs"))
        return model.eval()

    def _fuse_hf_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face names -> this module's parameter names, fusing q/k/v and gate/up; checks every shape."""
        remaining = dict(weights)
        expected = dict(self.named_parameters())
        state: dict[str, torch.Tensor] = {}

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
            return remaining.pop(name)

        def put(name: str, value: torch.Tensor) -> None:
            if tuple(expected[name].shape) != tuple(value.shape):
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(value.shape)}, expected {tuple(expected[name].shape)}"
                )
            state[name] = value.float().contiguous()

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        else:
            remaining.pop("lm_head.weight", None)  # some tied checkpoints store a copy
        for i in range(self.config.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            put(ours + "input_layernorm", take(hf + "input_layernorm.weight"))
            put(ours + "post_attention_layernorm", take(hf + "post_attention_layernorm.weight"))
            put(ours + "self_attn.qkv_proj.weight", torch.cat([take(hf + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            if self.config.attention_bias:
                put(ours + "self_attn.qkv_proj.bias", torch.cat([take(hf + f"self_attn.{x}_proj.bias") for x in "qkv"]))
            put(ours + "self_attn.o_proj.weight", take(hf + "self_attn.o_proj.weight"))
            gate_up = torch.cat([take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")])
            put(ours + "mlp.gate_up_proj.weight", gate_up)
            put(ours + "mlp.down_proj.weight", take(hf + "mlp.down_proj.weight"))
        remaining.pop("rope_freqs", None)  # GGUF's RoPE scaling, read by from_weights
        # Buffers some exporters save; they are recomputed from the config.
        for name in [n for n in remaining if n.endswith("rotary_emb.inv_freq")]:
            remaining.pop(name)
        if remaining:
            names = ", ".join(sorted(remaining)[:5])
            raise ModelLoadError(f"checkpoint has {len(remaining)} unexpected weights, e.g. {names}")
        return state

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None = full): what an attention context is built for."""
        return tuple(layer.self_attn.sliding_window for layer in self.layers)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: AttentionContext | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions `[N]` -> logits `[N, vocab]` (or only the rows in `logits_indices`)."""
        if kv is None:
            kv = ContiguousContext(positions, self.layer_windows)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, kv, i)
        if logits_indices is not None:
            x = x[logits_indices]
        x = F.rms_norm(x, x.shape[-1:], self.norm, self.config.rms_norm_eps)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return x @ head.T
