"""GGUF file -> ModelConfig + a stream of fp32 tensors (Hugging Face names) + tokenizer metadata.

What is particular to an architecture (its metadata fields, its tensor names, what llama.cpp's converter
did to its weights) comes from its family through the registry (kvserve.model.family); this module reads
any of them.

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

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kernels.kquant_packing import KQuantCodes
from kvserve.kernels.packing import GroupCodes
from kvserve.model.gguf_file import GGUFFile, GGUFTensorInfo
from kvserve.model.gguf_quants import (codes_held_exactly, dequantize, ggml_type_name, group_codes, kquant_codes,
                                      tensor_nbytes)
from kvserve.model.family import GGUF_GLOBAL_TENSORS
from kvserve.model.registry import GGUF, Architecture, find_architecture

# llama.cpp's MoE router, which its quantizer leaves in F32: held in 8 bits whatever the file's type
# (kvserve.model.moe.Router), so its type says nothing of how the file's matrices were quantized.
_ROUTER = "ffn_gate_inp.weight"
_SHARED_EXPERT_GATE = "ffn_gate_inp_shexp.weight"  # likewise (kvserve.model.moe.SharedExpertMoE)
# 2-D tensors of a layer that are not linear layers' matrices: LFM2's convolution kernels [hidden, L], Qwen3.5's
# [channels, kernel] (held in fp32 as the file gives them; llama.cpp keeps them F32 in quantized files).
_NOT_LINEAR = ("shortconv.conv.weight", "ssm_conv1d.weight")


@dataclass
class GGUFModel:
    config: ModelConfig
    file: GGUFFile
    architecture: Architecture  # what llama.cpp did to the weights, and its tensor names (kvserve.model.family)
    # tokenizer.* metadata keys, for kvserve.model.tokenizer
    tokenizer_metadata: dict[str, Any] = field(default_factory=dict)
    tensor_types: dict[str, int] = field(default_factory=dict)  # quant type -> tensor count

    @property
    def permuted_qk(self) -> bool:
        return self.architecture.gguf_permuted_qk

    @property
    def norm_shift(self) -> float:
        return self.architecture.gguf_norm_shift

    @property
    def linear_types(self) -> set[str]:
        """The quantization types of the layers' matrices (what the linear layers are loaded from)."""
        return {ggml_type_name(t.ggml_type) for t in self.file.tensors
                if t.name.startswith("blk.") and len(t.shape) in (2, 3)  # 3-D: stacked experts
                and not t.name.endswith((_ROUTER, _SHARED_EXPERT_GATE, *_NOT_LINEAR))
                and not t.name.endswith(".bias")}  # 2-D: stacked expert biases

    def weights(self, codes_held: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, fp32 tensor), dequantized one at a time as the consumer asks for it.

        GGUF's `rope_freqs` (Llama 3.1-style scaling) comes as ("rope_freqs", divisors), a family's other
        extra tensors by the names it gives them (kvserve.model.family), flattened like it. `codes_held`: the
        layers' matrices whose codes the layers hold exactly (K-quants, Q4_0 .. Q8_0 groups, MXFP4:
        `_codes_held`), whole or an expert's, come as meta tensors (a shape, no data), not dequantized, for a
        loader whose linear layers take the file's codes instead (`group_codes`; a fused projection mixing them
        with other types too) and write nothing for them (UnquantizedLinearMethod.load), so a 1B-class file
        neither dequantizes a billion weights only to drop them nor fills 4 GB of fp32 with zeros.
        """
        extras = _extra_tensors(self.architecture)
        fix = self.architecture.family.gguf_tensor_fix
        for part in self._parts:
            if codes_held and self._codes_held(part):
                yield part.hf_name, torch.empty(self._raw(part)[2], device="meta")
                continue
            type_name, raw, shape = self._raw(part)
            value = dequantize(raw, type_name, shape)
            if part.tensor.name in extras:
                yield extras[part.tensor.name], value.reshape(-1)
                continue
            hf_name = part.hf_name
            if self.norm_shift and hf_name.endswith("norm.weight"):
                value = value - self.norm_shift
            if self.permuted_qk and ".q_proj." in hf_name:
                value = unpermute_qk(value, self.config.num_heads)
            elif self.permuted_qk and ".k_proj." in hf_name:
                value = unpermute_qk(value, self.config.num_kv_heads)
            if fix is not None:
                value = fix(hf_name, value)
            yield hf_name, value

    def _codes_held(self, part: TensorPart) -> bool:
        """Whether group-quantized layers take this part's own codes whole, so that its fp32 is never made: a
        layer's matrix, or one expert's (a 30B MoE's experts in fp32 would not fit in memory), of a K-quant or
        group type whose scales and offsets fp16 holds exactly (`codes_held_exactly`; where it does not, the
        layer quantizes the fp32). Not the convolution kernels, which no linear layer takes."""
        tensor = part.tensor
        if (not tensor.name.startswith("blk.") or len(tensor.shape) - (part.expert is not None) != 2
                or tensor.name.endswith(_NOT_LINEAR)):
            return False
        type_name, raw, shape = self._raw(part)
        return codes_held_exactly(raw, type_name, shape)

    def group_codes(self, hf_name: str) -> GroupCodes | KQuantCodes | None:
        """The file's own codes of the matrix loaded as `hf_name` (Q/K rows unpermuted as in `weights`): group
        codes where its type is a group of w = d * q + m that a group-quantized linear layer holds exactly,
        its super-blocks where it is a K-quant (Q4_K, Q5_K, Q6_K); else None."""
        part = self._parts_by_hf_name.get(hf_name)
        if part is None:
            return None
        type_name, raw, shape = self._raw(part)
        if len(shape) != 2:
            return None
        codes = kquant_codes(raw, type_name, shape) or group_codes(raw, type_name, shape)
        if codes is None or not self.permuted_qk:
            return codes
        heads = {".q_proj.": self.config.num_heads, ".k_proj.": self.config.num_kv_heads}
        for part, num_heads in heads.items():
            if part in hf_name:  # the same row permutation as the fp32 weights get
                return codes.select_rows(unpermute_qk(torch.arange(shape[0]), num_heads))
        return codes

    @functools.cached_property
    def _parts(self) -> list[TensorPart]:
        return [part for tensor in self.file.tensors for part in tensor_parts(tensor, self.architecture)]

    @functools.cached_property
    def _parts_by_hf_name(self) -> dict[str | None, TensorPart]:
        return {part.hf_name: part for part in self._parts}

    def _raw(self, part: TensorPart) -> tuple[str, Any, tuple[int, ...]]:
        """(type name, raw bytes, shape) of one part: a whole tensor, or one expert's slice of a stacked one
        (quantization blocks lie within rows, so an expert's rows are its own run of bytes)."""
        tensor = part.tensor
        type_name = ggml_type_name(tensor.ggml_type)
        shape = tuple(int(n) for n in tensor.shape)
        if part.expert is None:
            return type_name, self.file.tensor_bytes(tensor, tensor_nbytes(type_name, shape)), shape
        shape = shape[1:]
        size = tensor_nbytes(type_name, shape)
        raw = self.file.tensor_bytes(tensor, size * int(tensor.shape[0]))
        return type_name, raw[part.expert * size : (part.expert + 1) * size], shape


@dataclass(frozen=True, slots=True)
class TensorPart:
    """What the loader streams as one Hugging Face tensor: a file's tensor, or one expert of a stacked one."""

    tensor: GGUFTensorInfo
    hf_name: str | None
    expert: int | None = None


def tensor_parts(tensor: GGUFTensorInfo, arch: Architecture) -> list[TensorPart]:
    """A tensor as the loader streams it: whole, or (a family's name with `{expert}`, a 3-D tensor of llama.cpp's
    stacked experts, or their stacked biases) one part per expert."""
    name = _hf_name(tensor.name, arch)
    if name is None or "{expert}" not in name:
        return [TensorPart(tensor, name)]
    if len(tensor.shape) != (2 if tensor.name.endswith(".bias") else 3):
        raise ModelLoadError(f"GGUF tensor {tensor.name} has shape {tensor.shape}: stacked experts are 3-D, "
                             "their biases 2-D")
    return [TensorPart(tensor, name.format(expert=e), e) for e in range(int(tensor.shape[0]))]


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved RoPE -> rotate-half layout)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _extra_tensors(arch: Architecture) -> dict[str, str]:
    """The file's tensors that are not parameters -> the names the model takes them by."""
    return {"rope_freqs.weight": "rope_freqs", **arch.family.gguf_extra_tensors}


def _hf_name(gguf_name: str, arch: Architecture) -> str | None:
    """The Hugging Face name of llama.cpp's tensor `gguf_name` in a model of `arch`; None if it has none."""
    if gguf_name in arch.family.gguf_global_tensors:
        return arch.family.gguf_global_tensors[gguf_name]
    if gguf_name in GGUF_GLOBAL_TENSORS:
        return GGUF_GLOBAL_TENSORS[gguf_name]
    layer_tensors = arch.family.gguf_layer_tensors
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
    config = replace(arch.family.read_gguf_config(meta, arch.name, vocab_rows),
                     attention_bias="blk.0.attn_q.bias" in by_name, tie_word_embeddings="output.weight" not in by_name)
    if arch.family.gguf_tensor_config is not None:
        config = arch.family.gguf_tensor_config(config, {name: tuple(t.shape) for name, t in by_name.items()})
    return file, arch, config


def read_gguf_config(path: str | Path) -> ModelConfig:
    """A GGUF model's shape without reading its weights (for memory planning)."""
    return _open(path)[2]


def load_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file: its config, tokenizer metadata and tensor types now; weights as streamed."""
    file, arch, config = _open(path)
    tensor_types: dict[str, int] = {}
    extras = _extra_tensors(arch)
    for tensor in file.tensors:
        if tensor.name in extras:
            continue
        if _hf_name(tensor.name, arch) is None:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} is not part of a supported {arch.name} model")
        type_name = ggml_type_name(tensor.ggml_type)
        tensor_types[type_name] = tensor_types.get(type_name, 0) + 1
    tokenizer_metadata = {k: v for k, v in file.metadata.items() if k.startswith("tokenizer.")}
    return GGUFModel(config, file, arch, tokenizer_metadata, tensor_types)
