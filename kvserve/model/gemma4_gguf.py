"""Gemma 4 as llama.cpp's converter writes it (GGUF arch `gemma4`): its metadata, its tensor names."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.errors import UnsupportedModelError
from kvserve.model.gemma4_config import Gemma4ModelConfig

GGUF_LAYER_TENSORS: dict[str, str] = {}
GGUF_GLOBAL_TENSORS: dict[str, str] = {}


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> Gemma4ModelConfig:
    raise UnsupportedModelError("Gemma 4 GGUF files are not supported yet")


def undo_gguf_conversion(hf_name: str, value: torch.Tensor) -> torch.Tensor:
    return value
