"""Gemma 4's shape: the fields only it has (`Gemma4ModelConfig`), and how a config.json says them.

Gemma 4's text decoder (transformers' Gemma4TextConfig, model_type `gemma4_text`) differs from Gemma 3 in what
each layer holds, so most of what it says goes to the per-layer K/V fields every model has (ModelConfig:
layer_kv_shapes, layer_k_eq_v, kv_source_layers) and the rest to the subclass below:

- sliding and full layers have their own head_dim and KV heads: the full ones `global_head_dim` and
  `num_global_key_value_heads` (transformers >= 5.24 writes them per layer: `per_layer_config`);
- with `attention_k_eq_v` the full layers project keys only and their values are those keys, RMS-normalized
  (no weight): the cache keeps V, and keys are rope(V * k_norm.weight);
- the last `num_kv_shared_layers` layers compute no K/V: each reads the cache of the last earlier layer of its
  own type (transformers' `kv_sharing_modes`);
- per-layer inputs (PLE, `hidden_size_per_layer_input`): a second embedding, of every layer's small input at
  once, mixed with a projection of the main embedding and fed into each layer after its MLP;
- the full layers rotate with "proportional" RoPE: a head_dim-wide rotation of which only the first
  `partial_rotary_factor` of the frequencies turn (the rest are 0: those channels pass unrotated);
- `enable_moe_block`: beside each layer's dense MLP, a mixture of experts whose outputs are added;
- `use_double_wide_mlp`: the KV-sharing layers' MLPs are twice as wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.family import hf_rope

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class Gemma4ModelConfig(ModelConfig):
    """A ModelConfig with what only Gemma 4 has (every other reader sees a ModelConfig). `num_kv_heads` and
    `head_dim` are the sliding layers'; `rope_local_theta` their RoPE base; `rope_theta` the full layers'."""

    # PLE: each layer's input width (0: no per-layer inputs) and the rows of their embedding.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # The full layers' proportional RoPE: the fraction of head_dim / 2 frequencies that turn, and the factor
    # every frequency is divided by.
    full_rope_fraction: float = 1.0
    full_rope_factor: float = 1.0
    # The KV-sharing layers' MLPs are 2 * intermediate_size wide.
    double_wide_mlp: bool = False

    def mlp_width(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width."""
        wide = self.double_wide_mlp and self.kv_source_of(layer) != layer
        return self.intermediate_size * (2 if wide else 1)


def kv_sources(layer_types: list[str], num_shared: int) -> tuple[int, ...]:
    """Each layer's cache: its own, or (one of the last `num_shared` layers) the last earlier layer of its type
    that stores its own (transformers' Gemma4TextConfig.kv_sharing_modes)."""
    first_shared = len(layer_types) - num_shared
    sources = list(range(len(layer_types)))
    for layer in range(first_shared, len(layer_types)):
        earlier = [i for i in range(first_shared) if layer_types[i] == layer_types[layer]]
        if not earlier:
            raise ModelLoadError(f"layer {layer} ({layer_types[layer]}) shares K/V, but no earlier layer of its "
                                 "type stores any")
        sources[layer] = earlier[-1]
    return tuple(sources)


def layer_shapes(layer_types: list[str], sliding: tuple[int, int], full: tuple[int, int], k_eq_v: bool,
                 sources: tuple[int, ...]) -> dict[str, Any]:
    """The per-layer K/V fields of a ModelConfig (shapes, K = V, sources) from each type's (KV heads, head_dim)."""
    shapes = tuple(full if kind == FULL else sliding for kind in layer_types)
    return dict(layer_kv_shapes=shapes, layer_k_eq_v=tuple(k_eq_v and kind == FULL for kind in layer_types),
                kv_source_layers=sources)


# --- config.json -----------------------------------------------------------------------------------------

# transformers' Gemma4TextConfig defaults, for the keys a config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "num_key_value_heads": 4, "sliding_window": 512, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144, "global_head_dim": 512,
}
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
CONDITIONAL = "Gemma4ForConditionalGeneration"


def read_hf_config(cfg: dict[str, Any], arch: str) -> Gemma4ModelConfig:
    """A Gemma4ForCausalLM config.json (model_type gemma4_text), or a Gemma4ForConditionalGeneration's (the
    Hub's checkpoints): its `text_config`, run as text only."""
    if arch == CONDITIONAL:
        if not isinstance(cfg.get("text_config"), dict):
            raise ModelLoadError(f"a {arch} config.json without its text_config")
        # transformers ties the head by the outer config's flag (True by default), not the text config's
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
    cfg = {**_HF_DEFAULTS, **{key: value for key, value in cfg.items() if value is not None}}
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 4 activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 4 with use_bidirectional_attention is not supported (text only, causal)")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("Gemma 4 with attention_bias=True is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    layer_types[-1] = FULL  # as transformers forces it
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(f"Gemma 4 layer_types must be {num_layers} of {SLIDING}, {FULL}; got {unknown}")
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    sliding = (int(cfg["num_key_value_heads"]), int(cfg["head_dim"]))
    full = _full_layer_shape(cfg, layer_types, sliding, k_eq_v)
    sources = kv_sources(layer_types, int(cfg.get("num_kv_shared_layers", 0)))
    params = {**_DEFAULT_ROPE, **(cfg.get("rope_parameters") or {})}
    local_theta, local_scaling = hf_rope(params[SLIDING], 10_000.0)
    if local_scaling.rope_type != "default":
        raise UnsupportedModelError(f"RoPE scaling on the sliding layers ({local_scaling.rope_type}) is not supported")
    full_rope = params[FULL]
    if full_rope.get("rope_type", "default") not in ("default", "proportional"):
        raise UnsupportedModelError(f"Gemma 4 full-layer RoPE {full_rope.get('rope_type')!r} is not supported; "
                                    "supported: default, proportional")
    proportional = full_rope.get("rope_type") == "proportional"
    window = int(cfg["sliding_window"])
    softcap = cfg.get("final_logit_softcapping")
    moe = _hf_moe(cfg)
    return Gemma4ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=sliding[0],
        head_dim=sliding[1],
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        sliding_window=window,
        layer_windows=tuple(window if kind == SLIDING else None for kind in layer_types),
        rope_local_theta=local_theta,
        final_logit_softcapping=float(softcap) if softcap else None,
        **moe,
        **layer_shapes(layer_types, sliding, full, k_eq_v, sources),
        per_layer_input_size=int(cfg["hidden_size_per_layer_input"] or 0),
        per_layer_vocab_size=int(cfg["vocab_size_per_layer_input"]),
        full_rope_fraction=float(full_rope.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
        full_rope_factor=float(full_rope.get("factor", 1.0)) if proportional else 1.0,
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
    )


def _full_layer_shape(cfg: dict[str, Any], layer_types: list[str], sliding: tuple[int, int],
                      k_eq_v: bool) -> tuple[int, int]:
    """(KV heads, head_dim) of the full layers: transformers' `per_layer_config` where the file has it (one
    entry per full layer, all alike), else `global_head_dim` and, with K = V, `num_global_key_value_heads`."""
    per_layer = cfg.get("per_layer_config")
    if per_layer:
        full = {(int(v.get("num_key_value_heads", sliding[0])), int(v.get("head_dim", sliding[1])))
                for k, v in per_layer.items() if layer_types[int(k)] == FULL}
        if any(layer_types[int(k)] != FULL for k in per_layer) or len(full) > 1:
            raise UnsupportedModelError("Gemma 4 per_layer_config other than one shape for every full layer "
                                        "is not supported")
        return full.pop() if full else sliding
    global_kv = cfg.get("num_global_key_value_heads")
    return (int(global_kv) if k_eq_v and global_kv else sliding[0], int(cfg["global_head_dim"]))


def _hf_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    if not cfg.get("enable_moe_block"):
        return {}
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not cfg.get(key):
            raise ModelLoadError(f"a Gemma 4 config.json with enable_moe_block but no {key}")
    # the router's top-k weights are always renormalised (then scaled per expert)
    return dict(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["top_k_experts"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True)


def gemma4_parameters(config: Gemma4ModelConfig) -> int:
    """Weights of a Gemma 4 decoder from its shape (for planning without them): per layer its own attention
    width, no K/V projections where it reads another's cache and no V projection where K = V, double-wide MLPs,
    the experts beside the MLP, and the per-layer inputs (PLE: E2B's embedding of them is half its weights)."""
    hidden, ple = config.hidden_size, config.per_layer_input_size
    total = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2) + hidden  # embedding, final norm
    if ple:  # the per-layer embedding, the projection of the main one into it, its norm
        total += (config.per_layer_vocab_size + hidden) * config.num_layers * ple + ple
    for layer in range(config.num_layers):
        kv_heads, head_dim = config.kv_shape_of(layer)
        width = config.num_heads * head_dim
        total += 2 * hidden * width + head_dim  # q_proj, o_proj, q_norm
        if config.kv_source_of(layer) == layer:  # k_proj (and v_proj unless K = V), k_norm
            total += hidden * kv_heads * head_dim * (1 if config.k_eq_v_of(layer) else 2) + head_dim
        total += 3 * hidden * config.mlp_width(layer) + 4 * hidden + 1  # the MLP, four norms, the layer scalar
        if ple:  # gate, projection, norm
            total += 2 * hidden * ple + hidden
        if config.num_experts:  # each expert's gated MLP, the router (projection, scales), three more norms
            total += (config.num_experts * (3 * config.moe_intermediate_size * hidden + hidden + 1)
                      + 4 * hidden)
    return total
