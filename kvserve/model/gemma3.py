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
llama.cpp's), so one `load_weights` serves both sources.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext, ContiguousContext
from kvserve.model.layers import GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding, VocabEmbedding
from kvserve.model.causal_lm import CausalLM

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
    """Decoder-only transformer, driven exactly like kvserve.model.llama.LlamaForCausalLM.

    `forward(input_ids, positions, kv)` runs a step's N new tokens at `positions`;
    `kv` stores their K/V and attends over what each request has cached, each layer
    within its own window. With `kv=None` the tokens must be one whole sequence.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # A Python float: multiplying an fp32 tensor by it rounds it to fp32, as transformers does when it
        # casts its scale to fp32 weights (in bf16 the scale itself would round: sqrt(640) -> 25.25).
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = _norm(config.hidden_size, config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:  # one tensor (not a checkpoint target twice); a quantized head converts a copy
            self.lm_head.weight = self.embed_tokens.weight
        # Global layers rotate with rope_theta and the scaling; windowed ones with their own base, unscaled.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary_emb = (RotaryEmbedding(config.head_dim, config.rope_local_theta)
                                 if any(layer.self_attn.local_rope for layer in self.layers) else None)

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
        # Each table once per step, shared by the layers that use it.
        global_rope = self.rotary_emb(positions)
        local_rope = self.local_rotary_emb(positions) if self.local_rotary_emb is not None else global_rope
        x = self.embed_tokens(input_ids) * self.embed_scale
        for i, layer in enumerate(self.layers):
            cos, sin = local_rope if layer.self_attn.local_rope else global_rope
            x = layer(x, cos, sin, kv, i)
        if logits_indices is not None:
            x = x[logits_indices]
        logits = self.lm_head(self.norm(x))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
