"""Hugging Face checkpoint directory (config.json + *.safetensors) -> ModelConfig + a stream of named tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.registry import HF, find_architecture


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 writes `rope_parameters` (theta included); older
    # checkpoints write `rope_theta` + `rope_scaling`. Accept both.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
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
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3")


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    architectures = cfg.get("architectures") or []
    arch = find_architecture(architectures[0] if architectures else None, HF).name
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope(cfg)
    if arch == "Qwen2ForCausalLM":
        attention_bias = True
        # Qwen2 declares a window but applies it only when use_sliding_window is set.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    else:
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=attention_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None,
    )


def read_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file, read one at a time, in the file's dtype."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weight files")
    return _stream_safetensors(files)


def _stream_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_checkpoint(directory: str | Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The model's config and its weights as a stream (nothing is read until it is iterated)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory not found: {directory}")
    return read_config(directory), read_weights(directory)
