"""Phi-3 and Phi-4-mini (Phi3ForCausalLM; GGUF `phi3`): a Llama decoder with fused projections, partial RoPE
and LongRoPE.

- The checkpoint stores Q/K/V as one `qkv_proj` and gate/up as one `gate_up_proj` (llama.cpp: `attn_qkv`, and
  `ffn_up` of twice the width): they load whole into the fused layers the Llama family builds anyway.
- Phi-4-mini rotates only the first 3/4 of each head (`partial_rotary_factor`; GGUF `rope.dimension_count`).
- The 128k models scale RoPE with LongRoPE (kvserve.model.rope_scaling): per-frequency factors, the long set
  once the model's context exceeds original_max_position_embeddings, and cos/sin scaled by an attention
  factor. A GGUF file holds the factors as tensors (`rope_factors_long`, `rope_factors_short`) and the factor
  as `phi3.rope.scaling.attn_factor`.
- A window (`sliding_window`) applies where it is shorter than the context (Phi-3-mini's 2047; Phi-4-mini's
  262144 never binds, and llama.cpp's converter writes 0 for none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError
from kvserve.model import llama
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily, gguf_config


class Phi3ForCausalLM(llama.LlamaForCausalLM):
    """Llama's layers; the checkpoint's fused projections load whole (no per-shard names)."""

    stacked_params = ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        scaling = self.rotary_emb.scaling
        if scaling.rope_type == "longrope" and not (scaling.short_factor and scaling.long_factor):
            raise ModelLoadError("the checkpoint declares LongRoPE but holds no rope_factors_short / "
                                 "rope_factors_long tensors")

    def extra_checkpoint_tensors(self) -> dict[str, Callable[[torch.Tensor], None]]:
        rotary = self.rotary_emb
        return {**super().extra_checkpoint_tensors(),
                "rope_factors_long": lambda factors: rotary.load_longrope_factors("long", factors),
                "rope_factors_short": lambda factors: rotary.load_longrope_factors("short", factors)}


def _window(window: Any, context: int) -> int | None:
    """A window that can bind (shorter than the context), or None."""
    return int(window) if window and int(window) < context else None


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A Phi3ForCausalLM config.json (model_type phi3): older ones give `rope_scaling` and put
    original_max_position_embeddings and partial_rotary_factor beside it, transformers 5 inside `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    for key in ("original_max_position_embeddings", "partial_rotary_factor", "rope_theta"):
        if key not in params and cfg.get(key) is not None:
            params[key] = cfg[key]
    config = llama.read_hf_config({**cfg, "rope_parameters": params, "rope_scaling": None}, arch)
    rotary_dim = int(config.head_dim * float(params.get("partial_rotary_factor", 1.0)))
    return replace(config, rotary_dim=rotary_dim if rotary_dim < config.head_dim else None,
                   sliding_window=_window(cfg.get("sliding_window"), config.max_position_embeddings))


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """Phi-3's `phi3.*` metadata: LongRoPE where the converter wrote its attention factor (the factors
    themselves are tensors, loaded with the weights)."""
    config = gguf_config(meta, arch, vocab_rows)
    attention = meta.get(f"{arch}.rope.scaling.attn_factor")
    scaling = config.rope_scaling
    if attention is not None:
        original = int(meta[f"{arch}.rope.scaling.original_context_length"])
        scaling = RopeScaling("longrope", factor=config.max_position_embeddings / original,
                              original_max_position_embeddings=original, attention_factor=float(attention))
    return replace(config, rope_scaling=scaling,
                   sliding_window=_window(meta.get(f"{arch}.attention.sliding_window"), config.max_position_embeddings))


GGUF_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate and up, fused, gate first
    "ffn_down.weight": "mlp.down_proj.weight",
}

FAMILY = ModelFamily(Phi3ForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS,
                     gguf_extra_tensors={"rope_factors_long.weight": "rope_factors_long",
                                         "rope_factors_short.weight": "rope_factors_short"})
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Phi3ForCausalLM", HF, FAMILY),
    Architecture("phi3", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted
)
