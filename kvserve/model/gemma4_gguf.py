"""Gemma 4 as llama.cpp's converter writes it (GGUF arch `gemma4`, convert_hf_to_gguf.py's Gemma4Model).

The metadata says each layer's kind (`attention.sliding_window_pattern`, true for a sliding layer), the two head
widths (`attention.key_length` for the full layers, `key_length_swa` for the sliding ones), the KV heads (one
count, or one per layer where the full layers have their own), the MLP widths (one, or one per layer where the
KV-sharing layers' are double), the two RoPE bases (`rope.freq_base`, `rope.freq_base_swa`), the KV-sharing
layers' count, the per-layer inputs' width. What it leaves to the tensors:

- K = V: a full layer stores no `attn_v` (llama.cpp then takes V from the K projection);
- proportional RoPE: the full layers rotate over their whole head (`rope.dimension_count` = key_length) with
  `rope_freqs` dividing each frequency (1 for the turning ones, 1e30 for the rest: llama.cpp's freq_factors);
- the per-layer inputs' vocabulary: `per_layer_token_embd`'s rows.

The norms are stored as they are (Gemma 4 scales by w, not 1 + w: no shift), Q/K unpermuted (NEOX RoPE); the
router's scale is `ffn_gate_inp.scale`, its per-expert scale `ffn_down_exps.scale`; the experts' gate and up
projections are stacked into one `ffn_gate_up_exps` (gate rows first, as transformers holds them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.family import GGUF_PROJECTION_TENSORS
from kvserve.model.gemma4_config import FULL, SLIDING, Gemma4ModelConfig, kv_sources, layer_shapes


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> Gemma4ModelConfig:
    """Gemma 4's shape from llama.cpp's `gemma4.*` metadata (K = V and the per-layer inputs' vocabulary come from
    the tensors: `tensor_config`)."""

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_layers = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, (bool, int)) or len(pattern) != num_layers:
        raise UnsupportedModelError(f"{arch}.attention.sliding_window_pattern must list {num_layers} layers")
    layer_types = [SLIDING if swa else FULL for swa in pattern]
    full_dim = int(get("attention.key_length"))
    swa_dim = int(get("attention.key_length_swa", full_dim))
    if (int(get("attention.value_length", full_dim)), int(get("attention.value_length_swa", swa_dim))) != (
            full_dim, swa_dim):
        raise UnsupportedModelError("Gemma 4 value heads of another width than the key heads are not supported")
    if int(get("rope.dimension_count_swa", swa_dim)) != swa_dim:
        raise UnsupportedModelError("partial RoPE on Gemma 4's sliding layers is not supported")
    if int(get("rope.dimension_count", full_dim)) != full_dim:
        raise UnsupportedModelError("a rope.dimension_count other than the full layers' head width is not supported")
    kv_heads = _per_type(get("attention.head_count_kv"), layer_types, "attention.head_count_kv")
    widths = _per_layer(get("feed_forward_length"), num_layers)
    sources = kv_sources(layer_types, int(get("attention.shared_kv_layers", 0)))
    base = widths[0]
    double_wide = any(width != base for width in widths)
    if any(width != (2 * base if double_wide and sources[i] != i else base) for i, width in enumerate(widths)):
        raise UnsupportedModelError(f"Gemma 4 MLP widths {widths} are not one width (doubled on the KV-sharing "
                                    "layers)")
    window = int(get("attention.sliding_window"))
    softcap = meta.get(f"{arch}.final_logit_softcapping")
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    moe = dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
               moe_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True) if experts else {}
    return Gemma4ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_rows)),
        hidden_size=int(get("embedding_length")),
        intermediate_size=base,
        num_layers=num_layers,
        num_heads=int(get("attention.head_count")),
        num_kv_heads=kv_heads[SLIDING] if SLIDING in kv_heads else kv_heads[FULL],
        head_dim=swa_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 1_000_000.0)),
        sliding_window=window,
        layer_windows=tuple(window if kind == SLIDING else None for kind in layer_types),
        rope_local_theta=float(get("rope.freq_base_swa", 10_000.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        **moe,
        **layer_shapes(layer_types, (kv_heads.get(SLIDING, 0), swa_dim), (kv_heads.get(FULL, 0), full_dim), False,
                       sources),
        per_layer_input_size=int(get("embedding_length_per_layer_input", 0)),
        per_layer_vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_rows)),
        double_wide_mlp=double_wide,
    )


def _per_layer(value: Any, num_layers: int) -> list[int]:
    values = [int(value)] * num_layers if isinstance(value, int) else [int(v) for v in value]
    if len(values) != num_layers:
        raise ModelLoadError(f"a per-layer GGUF value has {len(values)} entries for {num_layers} layers")
    return values


def _per_type(value: Any, layer_types: list[str], key: str) -> dict[str, int]:
    """One count per layer type from a GGUF value that is one count, or one per layer alike within each type."""
    values = _per_layer(value, len(layer_types))
    by_type: dict[str, set[int]] = {}
    for kind, count in zip(layer_types, values):
        by_type.setdefault(kind, set()).add(count)
    if any(len(counts) > 1 for counts in by_type.values()):
        raise UnsupportedModelError(f"Gemma 4 {key} differing within a layer type is not supported: {values}")
    return {kind: counts.pop() for kind, counts in by_type.items()}


def tensor_config(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> ModelConfig:
    """K = V where the full layers that store K/V have no V projection (every one of them or none); the per-layer
    inputs' vocabulary from their embedding's rows."""
    kinds = [FULL if window is None else SLIDING for window in (config.layer_windows or ())]
    full = [i for i in config.kv_storing_layers if kinds[i] == FULL]
    without_v = {i for i in full if f"blk.{i}.attn_v.weight" not in shapes}
    if without_v and without_v != set(full):
        raise UnsupportedModelError(f"Gemma 4 full layers {sorted(without_v)} have no V projection, the others do")
    shape_of = {kind: config.kv_shape_of(kinds.index(kind)) for kind in set(kinds)}
    fields = layer_shapes(kinds, shape_of.get(SLIDING, (0, 0)), shape_of.get(FULL, (0, 0)), bool(without_v),
                          config.kv_source_layers or tuple(range(len(kinds))))
    embedding = shapes.get("per_layer_token_embd.weight")
    rows = {"per_layer_vocab_size": embedding[0]} if embedding else {}
    return replace(config, **fields, **rows)


# llama.cpp's names for Gemma 4's model-wide tensors beyond every family's (the per-layer inputs').
GGUF_GLOBAL_TENSORS: dict[str, str] = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# gguf-py's tensor map for MODEL_ARCH.GEMMA4 (stacked experts: `{expert}`, kvserve.model.gguf).
GGUF_LAYER_TENSORS: dict[str, str] = {
    **GGUF_PROJECTION_TENSORS,
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.{expert}.gate_up_proj.weight",
    "ffn_down_exps.weight": "experts.{expert}.down_proj.weight",
}


def undo_gguf_conversion(hf_name: str, value: torch.Tensor) -> torch.Tensor:
    """A GGUF file's tensor as Hugging Face holds it: the 1-element and per-vector scales as 1-D tensors."""
    if hf_name.endswith((".layer_scalar", ".router.scale", ".router.per_expert_scale")):
        return value.reshape(-1)
    return value
