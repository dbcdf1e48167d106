"""What a model family declares to the registry, and the readers families share.

A family file (kvserve.model.llama, kvserve.model.gemma3) holds everything about its models: the
modules, how its Hugging Face config.json and its GGUF metadata become a `ModelConfig`, and the names
llama.cpp gives its tensors. It declares them as a `ModelFamily` and lists its `Architecture`s (the
names its sources use); kvserve.model.registry collects the lists, and the checkpoint and GGUF readers
ask the registry, never a family by name. A new family is one such file plus its line in the registry.

The helpers below are what every family reads the same way: RoPE parameters in a config.json, and the
llama.cpp metadata keys (`{arch}.block_count`, ...) that every GGUF architecture writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.causal_lm import CausalLM

if TYPE_CHECKING:
    import torch

HF = "hf"
GGUF = "gguf"

# config.json (a dict) and the architecture name it gave -> the model's shape.
HFConfigReader = Callable[[dict[str, Any], str], ModelConfig]
# GGUF metadata, the architecture name and the embedding's row count -> the model's shape.
GGUFConfigReader = Callable[[dict[str, Any], str, int], ModelConfig]
# A GGUF model's shape and the file's tensor shapes by name -> the shape as the tensors tell the rest of it.
GGUFTensorConfig = Callable[[ModelConfig, Mapping[str, tuple[int, ...]]], ModelConfig]


@dataclass(frozen=True, slots=True, eq=False)
class ModelFamily:
    """One family's model class and readers (one object per family: compared and hashed by identity)."""

    model_class: type[CausalLM]
    read_hf_config: HFConfigReader
    read_gguf_config: GGUFConfigReader
    # llama.cpp's per-layer tensor names (after `blk.N.`) -> Hugging Face names (after `model.layers.N.`).
    gguf_layer_tensors: Mapping[str, str]
    # Architecture names a source may give that this family recognizes but does not run -> why (the error).
    refused: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's tensors that are not parameters -> the name the model's `extra_checkpoint_tensors` takes
    # them by (Phi-3's LongRoPE factors), beside `rope_freqs` which every family may have.
    gguf_extra_tensors: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's model-wide tensors this family names otherwise than GGUF_GLOBAL_TENSORS does -> Hugging Face
    # names (LFM2's final norm is `token_embd_norm`).
    gguf_global_tensors: Mapping[str, str] = field(default_factory=dict)
    # (Hugging Face name, tensor as the file holds it) -> the tensor as Hugging Face holds it, for what llama.cpp's
    # converter did to a family's own tensors beyond the shared transforms below (Qwen3.5's A_log stored as
    # -exp(A_log)); None: nothing. Only tensors that are not linear layers' matrices (those load the file's codes).
    gguf_tensor_fix: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    # What the metadata leaves to the tensors (Gemma 4: which full layers have no V projection, K = V); None:
    # the metadata says it all.
    gguf_tensor_config: GGUFTensorConfig | None = None


@dataclass(frozen=True, slots=True)
class Architecture:
    """A name a source gives a model (config.json's `architectures[0]`, GGUF's `general.architecture`)."""

    name: str
    source: str  # HF or GGUF
    family: ModelFamily
    # llama.cpp's converter permutes the rows of Q and K for architectures
    # whose ggml RoPE is the interleaved kind ("llama"); the loader undoes it.
    gguf_permuted_qk: bool = False
    # llama.cpp's converter adds this to every norm weight (Gemma's (1 + w) norms are stored as
    # 1 + w); the GGUF reader subtracts it so the model loads Hugging Face's w either way.
    gguf_norm_shift: float = 0.0

    @property
    def model_class(self) -> type[CausalLM]:
        return self.family.model_class


# llama.cpp's names for what every family has (its LLM_TENSOR names are shared across architectures).
GGUF_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_PROJECTION_TENSORS: dict[str, str] = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_rope(params: dict[str, Any], default_theta: float,
            max_position_embeddings: int | None = None) -> tuple[float, RopeScaling]:
    """(theta, scaling) from one set of RoPE parameters (`rope_parameters` or an older `rope_scaling`);
    `max_position_embeddings` over the original context is YaRN's and LongRoPE's factor where they omit it."""
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if rope_type in ("yarn", "longrope", "su"):
        return theta, _hf_long_context_rope("yarn" if rope_type == "yarn" else "longrope", params,
                                            max_position_embeddings)
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, "
                                "llama3, yarn, longrope")


def _hf_long_context_rope(rope_type: str, params: dict[str, Any], max_position_embeddings: int | None) -> RopeScaling:
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ModelLoadError(f"{rope_type} RoPE scaling without original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ModelLoadError(f"{rope_type} RoPE scaling without a factor")
        factor = max_position_embeddings / int(original)
    attention = params.get("attention_factor")
    common = dict(factor=float(factor), original_max_position_embeddings=int(original),
                  attention_factor=None if attention is None else float(attention))
    if rope_type == "longrope":
        return RopeScaling("longrope", short_factor=tuple(float(f) for f in params["short_factor"]),
                           long_factor=tuple(float(f) for f in params["long_factor"]), **common)
    return RopeScaling(
        "yarn", beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]), **common)


def gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """The shape every llama.cpp architecture writes as `{arch}.*` metadata (a family adds its own fields).
    Attention bias and tied embeddings are not metadata: the GGUF reader sets them from the tensors."""

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModelError(f"value heads of {value_dim} (key heads {head_dim}) are not supported")
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise UnsupportedModelError(f"a rope dimension of {rope_dim} (head_dim {head_dim}) is not supported")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("none", None):
        scaling = RopeScaling()
    elif scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    elif scaling_type == "yarn":
        scaling = _gguf_yarn(meta, arch)
    else:
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling_type!r} is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_rows)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias=False,
        tie_word_embeddings=False,
        rotary_dim=rope_dim if rope_dim < head_dim else None,
    )


def _gguf_yarn(meta: dict[str, Any], arch: str) -> RopeScaling:
    """YaRN as llama.cpp's converter writes it: `yarn_log_multiplier` is transformers' mscale_all_dim, and the
    converter writes no separate mscale (Ministral 3's equal it), so the two are read as one."""
    key = f"{arch}.rope.scaling."
    log_multiplier = meta.get(key + "yarn_log_multiplier")
    attention = meta.get(key + "yarn_attn_factor", meta.get(key + "attn_factor"))
    mscale = None if not log_multiplier else float(log_multiplier)
    return RopeScaling(
        "yarn", factor=float(meta[key + "factor"]),
        original_max_position_embeddings=int(meta[key + "original_context_length"]),
        beta_fast=float(meta.get(key + "yarn_beta_fast", 32.0)), beta_slow=float(meta.get(key + "yarn_beta_slow", 1.0)),
        mscale=mscale, mscale_all_dim=mscale, attention_factor=None if attention is None else float(attention))
