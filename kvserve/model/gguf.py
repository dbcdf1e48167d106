"""GGUF file -> ModelConfig + a stream of fp32 tensors (Hugging Face names) + tokenizer metadata.

The container is read by `gguf_file` (a memory map; nothing is copied until a
tensor is dequantized). Dequantization is ours (`gguf_quants`), per tensor, as
the loader streams it into the model, because files often mix types
(SmolLM2's Q4_1 file keeps its embedding in Q8_0 and its norms in F32).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kernels.packing import GroupCodes
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.gguf_quants import dequantize, ggml_type_name, group_codes, tensor_nbytes
from kvserve.model.registry import GGUF, Architecture, find_architecture

_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp names Gemma 3's four norms after what they follow: `ffn_norm` is the pre-feedforward
# norm there (Llama's post-attention norm), `post_attention_norm` the norm of the attention output.
_GEMMA3_LAYER_TENSORS: dict[str, str] = {
    **{k: v for k, v in _LAYER_TENSORS.items() if not k.startswith("ffn_norm") and ".bias" not in k},
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER_TENSORS_BY_ARCH: dict[str, dict[str, str]] = {"gemma3": _GEMMA3_LAYER_TENSORS}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class GGUFModel:
    config: ModelConfig
    file: GGUFFile
    permuted_qk: bool  # llama.cpp permuted the rows of Q and K (see registry)
    norm_shift: float = 0.0  # what llama.cpp added to every norm weight (see registry)
    # tokenizer.* metadata keys, for kvserve.model.tokenizer
    tokenizer_metadata: dict[str, Any] = field(default_factory=dict)
    tensor_types: dict[str, int] = field(default_factory=dict)  # quant type -> tensor count

    @property
    def linear_types(self) -> set[str]:
        """The quantization types of the layers' matrices (what the linear layers are loaded from)."""
        return {ggml_type_name(t.ggml_type) for t in self.file.tensors
                if t.name.startswith("blk.") and len(t.shape) == 2}

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, fp32 tensor), dequantized one at a time as the consumer asks for it.

        GGUF's `rope_freqs` (Llama 3.1-style scaling) comes as ("rope_freqs", divisors).
        """
        for tensor in self.file.tensors:
            type_name = ggml_type_name(tensor.ggml_type)
            raw = self.file.tensor_bytes(tensor, tensor_nbytes(type_name, tensor.shape))
            value = dequantize(raw, type_name, tensor.shape)
            if tensor.name == "rope_freqs.weight":
                yield "rope_freqs", value.reshape(-1)
                continue
            hf_name = _hf_name(tensor.name, self.config.architecture)
            if self.norm_shift and hf_name.endswith("norm.weight"):
                value = value - self.norm_shift
            if self.permuted_qk and ".q_proj." in hf_name:
                value = unpermute_qk(value, self.config.num_heads)
            elif self.permuted_qk and ".k_proj." in hf_name:
                value = unpermute_qk(value, self.config.num_kv_heads)
            yield hf_name, value

    def group_codes(self, hf_name: str) -> GroupCodes | None:
        """The file's own codes of the matrix loaded as `hf_name` (Q/K rows unpermuted as in `weights`), where
        its type is a group of w = d * q + m that a group-quantized linear layer holds exactly; else None."""
        tensor = self._tensors_by_hf_name.get(hf_name)
        if tensor is None:
            return None
        type_name = ggml_type_name(tensor.ggml_type)
        shape = tuple(int(n) for n in tensor.shape)
        if len(shape) != 2:
            return None
        codes = group_codes(self.file.tensor_bytes(tensor, tensor_nbytes(type_name, shape)), type_name, shape)
        if codes is None or not self.permuted_qk:
            return codes
        heads = {".q_proj.": self.config.num_heads, ".k_proj.": self.config.num_kv_heads}
        for part, num_heads in heads.items():
            if part in hf_name:  # the same row permutation as the fp32 weights get
                return codes.select_rows(unpermute_qk(torch.arange(shape[0]), num_heads))
        return codes

    @functools.cached_property
    def _tensors_by_hf_name(self) -> dict[str | None, Any]:
        return {_hf_name(t.name, self.config.architecture): t for t in self.file.tensors}


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved RoPE -> rotate-half layout)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
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
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial RoPE (rope dimension {rope_dim} < head_dim {head_dim}) is not supported")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("none", None):
        scaling = RopeScaling()
    elif scaling_type == "linear":
        scaling = RopeScaling("linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
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
        attention_bias=False,  # set by _open from the tensors present
        tie_word_embeddings=False,
        **(_gemma3_fields(meta, int(get("block_count")), hidden, num_heads, head_dim) if arch == "gemma3" else {}),
    )


# Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3): the file gives the window but not which
# layers use it, nor their RoPE base, nor the attention scale.
GEMMA3_WINDOW_PATTERN = 6  # five sliding-window layers, then one global
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose query_pre_attn_scalar is hidden / heads rather than head_dim


def _gemma3_fields(meta: dict[str, Any], num_layers: int, hidden: int, num_heads: int, head_dim: int) -> dict:
    window = int(meta.get("gemma3.attention.sliding_window") or 0)  # absent or 0: every layer global
    windows = tuple(window if window and (i + 1) % GEMMA3_WINDOW_PATTERN else None for i in range(num_layers))
    softcap = meta.get("gemma3.final_logit_softcapping")
    return dict(
        sliding_window=window or None,
        layer_windows=windows,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=hidden // num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim,
        final_logit_softcapping=float(softcap) if softcap else None,
    )


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _LAYER_TENSORS_BY_ARCH.get(arch, _LAYER_TENSORS)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    return None


def _open(path: str | Path) -> tuple[GGUFFile, Architecture, ModelConfig]:
    """The file, its architecture, and the model's shape (from metadata and tensor names only)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    file = GGUFFile(path)
    meta = file.metadata
    arch = find_architecture(meta.get("general.architecture"), GGUF)
    by_name = {t.name: t for t in file.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor")
    vocab_rows = int(by_name["token_embd.weight"].shape[0])
    config = replace(_config(meta, arch.name, vocab_rows), attention_bias="blk.0.attn_q.bias" in by_name,
                     tie_word_embeddings="output.weight" not in by_name)
    return file, arch, config


def read_gguf_config(path: str | Path) -> ModelConfig:
    """A GGUF model's shape without reading its weights (for memory planning)."""
    return _open(path)[2]


def load_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file: its config, tokenizer metadata and tensor types now; weights as streamed."""
    file, arch, config = _open(path)
    tensor_types: dict[str, int] = {}
    for tensor in file.tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        if _hf_name(tensor.name, arch.name) is None:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} is not part of a supported {arch.name} model")
        type_name = ggml_type_name(tensor.ggml_type)
        tensor_types[type_name] = tensor_types.get(type_name, 0) + 1
    tokenizer_metadata = {k: v for k, v in file.metadata.items() if k.startswith("tokenizer.")}
    return GGUFModel(config, file, arch.gguf_permuted_qk, arch.gguf_norm_shift, tokenizer_metadata, tensor_types)
