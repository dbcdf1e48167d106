"""Ministral 3, text (Ministral3ForCausalLM, or the text part of Mistral3ForConditionalGeneration checkpoints
converted by llama.cpp; GGUF `mistral3`): a Llama decoder with YaRN RoPE and an attention temperature.

- RoPE is YaRN-scaled (kvserve.model.rope_scaling), cos and sin times its attention factor.
- Queries are multiplied by 1 + beta * log(1 + floor(p / original context)) at position p (Llama 4's
  temperature, `llama_4_scaling_beta`; llama.cpp's `attention.temperature_scale`): 1 within the original
  context, growing past it. Keys are not, so the cache holds what any layer of the Llama family would.
- No sliding window (transformers applies `sliding_window` where a config gives one; Ministral 3's give none).

The temperature is a per-token value like cos and sin, so it travels with them: this family's RoPE tables
carry it as one more column of `cos` ([T, rotary_dim + 1]), which its attention splits off.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext
from kvserve.model import llama
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily, gguf_config


class Ministral3Attention(llama.Attention):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        query_scale, cos = cos[:, -1:], cos[:, :-1]
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        ops.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q = (qkv[:, :q_size] * query_scale).view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv.attend(layer, q, k, v, self.scale))


class Ministral3DecoderLayer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.self_attn = Ministral3Attention(config, layer_index)


class Ministral3ForCausalLM(llama.LlamaForCausalLM):
    """Llama's decoder with YaRN and the query temperature."""

    decoder_layer = Ministral3DecoderLayer

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """What the queries at `positions` `[T]` are multiplied by, `[T, 1]`."""
        beta = self.config.query_temperature_beta or 0.0
        original = self.config.rope_scaling.original_max_position_embeddings
        return (1 + beta * torch.log(1 + torch.floor(positions.float() / original)))[:, None]

    def rope_tables(self, positions: torch.Tensor) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.rotary_emb(positions)
        tables = (torch.cat((cos, self.query_scale(positions)), dim=-1), sin)
        return [tables] * len(self.layers)


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Ministral3ForCausalLM config.json (model_type ministral3); a Mistral3ForConditionalGeneration's
    `text_config` is one too."""
    config = llama.read_hf_config({**cfg, "sliding_window": None}, arch)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    return replace(config, query_temperature_beta=None if beta is None else float(beta))


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """Ministral 3's `mistral3.*` metadata: the Llama shape, YaRN, the temperature's beta."""
    config = gguf_config(meta, arch, vocab_rows)
    beta = meta.get(f"{arch}.attention.temperature_scale")
    return replace(config, query_temperature_beta=float(beta) if beta else None)


FAMILY = ModelFamily(
    Ministral3ForCausalLM, read_hf_config, read_gguf_config, llama.GGUF_LAYER_TENSORS,
    refused={"Mistral3ForConditionalGeneration": (
        "Mistral3ForConditionalGeneration (Ministral 3 with its vision encoder) is not supported: load a text-only "
        "checkpoint (Ministral3ForCausalLM) or a Ministral 3 GGUF file (`mistral3`)")},
)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Ministral3ForCausalLM", HF, FAMILY),
    Architecture("mistral3", GGUF, FAMILY, gguf_permuted_qk=True),  # converted as a Llama: Q/K permuted
)
