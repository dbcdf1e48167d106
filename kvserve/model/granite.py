"""Granite 3 and Granite 4 dense (GraniteForCausalLM; GGUF `granite`): a Llama decoder with muP multipliers.

Four numbers from training that inference must apply where transformers does: the embeddings are multiplied
by `embedding_multiplier`; each layer's attention and MLP outputs by `residual_multiplier` before joining the
residual stream; `attention_multiplier` is the attention scale (in place of head_dim**-0.5); the logits are
divided by `logits_scaling`. llama.cpp's converter writes them as `granite.embedding_scale`,
`granite.residual_scale`, `granite.attention.scale` and `granite.logit_scale`, and permutes Q/K as for Llama.

Granite 4's attention-only sizes (granite-4.0-micro) are GraniteMoeHybridForCausalLM checkpoints with every
layer `attention`, no experts and RoPE: the same decoder, its MLP stored as `shared_mlp.input_linear` (gate and
up, fused) and `shared_mlp.output_linear`, of `shared_intermediate_size`. llama.cpp's converter writes them as
`granite` files. The hybrid ones (Mamba layers), the MoE ones and those without RoPE are refused by name.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedModelError
from kvserve.kv.attention import AttentionContext
from kvserve.model import llama
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily, gguf_config


class GraniteDecoderLayer(llama.DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        """As Llama's, each branch scaled before it joins x (which is updated in place)."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer)
        normed = self.post_attention_layernorm.add_and_norm(x, attended * self.residual_multiplier)
        return x.add_(self.mlp(normed) * self.residual_multiplier)


class GraniteForCausalLM(llama.LlamaForCausalLM):
    """Granite's decoder: Llama's layers with scaled branches, a scaled embedding and divided logits."""

    decoder_layer = GraniteDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_granite4_names(weights))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)) / self.config.logits_scaling


def _granite4_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite 4's shared-MLP tensors under Llama's names (its fused gate/up split, gate first); others as they are."""
    for name, tensor in weights:
        if name.endswith(".shared_mlp.input_linear.weight"):
            prefix = name.removesuffix("shared_mlp.input_linear.weight")
            gate, up = tensor.chunk(2, dim=0)
            yield prefix + "mlp.gate_proj.weight", gate
            yield prefix + "mlp.up_proj.weight", up
        elif name.endswith(".shared_mlp.output_linear.weight"):
            yield name.removesuffix("shared_mlp.output_linear.weight") + "mlp.down_proj.weight", tensor
        else:
            yield name, tensor


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A GraniteForCausalLM config.json (model_type granite)."""
    config = llama.read_hf_config(cfg, arch)
    return replace(
        config,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
    )


def read_granite4_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A GraniteMoeHybridForCausalLM config.json of the attention-only, expert-free kind (Granite 4 dense)."""
    kinds = set(cfg.get("layer_types") or cfg.get("layers_block_type") or [])
    if not kinds <= {"attention", "full_attention"}:
        raise UnsupportedModelError(f"Granite 4 hybrid layers ({', '.join(sorted(kinds))}) are not supported: only the "
                                    "attention-only sizes (granite-4.0-micro)")
    if cfg.get("num_local_experts"):
        raise UnsupportedModelError("Granite 4 with experts (num_local_experts > 0) is not supported")
    if cfg.get("position_embedding_type") != "rope":
        raise UnsupportedModelError(f"Granite 4 position_embedding_type {cfg.get('position_embedding_type')!r} is not "
                                    "supported (only rope)")
    return read_hf_config({**cfg, "intermediate_size": cfg["shared_intermediate_size"]}, arch)


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """Granite's `granite.*` metadata: the Llama shape and the four multipliers (absent: llama.cpp's defaults)."""
    config = gguf_config(meta, arch, vocab_rows)
    scale = meta.get(f"{arch}.attention.scale")
    return replace(
        config,
        embedding_multiplier=float(meta.get(f"{arch}.embedding_scale", 1.0)),
        residual_multiplier=float(meta.get(f"{arch}.residual_scale", 1.0)),
        logits_scaling=float(meta.get(f"{arch}.logit_scale", 1.0)),
        attention_multiplier=None if not scale else float(scale),
    )


def read_any_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    return read_granite4_hf_config(cfg, arch) if arch == GRANITE4 else read_hf_config(cfg, arch)


GRANITE4 = "GraniteMoeHybridForCausalLM"
FAMILY = ModelFamily(GraniteForCausalLM, read_any_hf_config, read_gguf_config, llama.GGUF_LAYER_TENSORS)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("GraniteForCausalLM", HF, FAMILY),
    Architecture(GRANITE4, HF, FAMILY),
    Architecture("granite", GGUF, FAMILY, gguf_permuted_qk=True),
)
