"""Hugging Face checkpoint directory (config.json + *.safetensors) -> ModelConfig + a stream of named tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.model.registry import HF, find_architecture


def read_config(directory: Path) -> ModelConfig:
    """config.json -> the model's shape, read by its architecture's family (kvserve.model.registry)."""
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    architectures = cfg.get("architectures") or []
    arch = find_architecture(architectures[0] if architectures else None, HF)
    return arch.family.read_hf_config(cfg, arch.name)


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
