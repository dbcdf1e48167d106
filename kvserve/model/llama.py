"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in PyTorch.

Built from the shared layers (kvserve.model.layers). Weights arrive with
Hugging Face names and are streamed into the parameters by `load_weights`;
Q/K/V and gate/up are fused into one matmul each (fewer, larger GEMMs: the
decode step is dominated by per-call overhead at small batch), each
checkpoint tensor written into its rows of the fused weight. Attention
reaches the KV cache only through the forward's `AttentionContext.attend`
(kvserve.kv.attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext, ContiguousContext
from kvserve.model.layers import GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding, VocabEmbedding
from kvserve.model.causal_lm import CausalLM


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window_for_layer(layer_index)  # this layer's attention kind
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size)

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
        qkv = self.qkv_proj(x)
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

    def forward(self, x, positions, cos, sin, kv, layer) -> torch.Tensor:
        """x, the residual stream, is updated in place (the model's own activations, nothing else's)."""
        normed = self.input_layernorm(x)
        normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn(normed, positions, cos, sin, kv, layer))
        return x.add_(self.mlp(normed))


class LlamaForCausalLM(CausalLM):
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
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:  # one tensor (not a checkpoint target twice); a quantized head converts a copy
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def extra_checkpoint_tensors(self) -> dict[str, Callable[[torch.Tensor], None]]:
        return {"rope_freqs": self.rotary_emb.load_freq_divisors}  # GGUF: Llama 3.1-style scaling as divisors

    def shift_key_positions(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Cached keys `[T, KVH, D]` (RoPE applied) as if computed `delta` positions later: RoPE is a rotation
        by position, so rotating by `delta` moves them (a context shift's re-rotation, as llama.cpp does)."""
        cos, sin = self.rotary_emb(torch.tensor([delta]))
        return ops.apply_rope(keys, cos, sin)

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
        cos, sin = self.rotary_emb(positions)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, kv, i)
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        return self.lm_head(x)
