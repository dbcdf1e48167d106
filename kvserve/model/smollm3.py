"""SmolLM3 (SmolLM3ForCausalLM; GGUF `smollm3`): a Llama decoder whose every fourth layer has no RoPE.

The layers run as the Llama family's (kvserve.model.llama), which skips the rotation on a layer that
`ModelConfig.rope_layers` marks False; a context shift leaves those layers' keys as they are (they carry no
position). config.json lists the layers (`no_rope_layers`, 1 = rotates) or gives the interval; llama.cpp
hard-codes the interval (4) and writes nothing about it. A SmolLM3 config.json may also opt some layers into
a sliding window (`use_sliding_window` + `layer_types`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedModelError
from kvserve.model import llama
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily, gguf_config

GGUF_NO_ROPE_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for LLM_ARCH_SMOLLM3
_SLIDING = "sliding_attention"


def no_rope_every(interval: int, num_layers: int) -> tuple[bool, ...]:
    """Which layers rotate when every `interval`-th one (the 4th, 8th, ...) does not."""
    return tuple((i + 1) % interval != 0 for i in range(num_layers))


def read_hf_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """A SmolLM3ForCausalLM config.json (model_type smollm3)."""
    config = llama.read_hf_config({"tie_word_embeddings": True, **cfg}, arch)
    listed = cfg.get("no_rope_layers")
    rope_layers = (tuple(bool(flag) for flag in listed) if listed is not None
                   else no_rope_every(int(cfg.get("no_rope_layer_interval", 4)), config.num_layers))
    windows = None
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        # transformers' default layer_types: the no-RoPE layers slide
        layer_types = cfg.get("layer_types") or [_SLIDING if not rotates else "full_attention"
                                                  for rotates in rope_layers]
        windows = tuple(int(cfg["sliding_window"]) if kind == _SLIDING else None for kind in layer_types)
    if len(rope_layers) != config.num_layers:
        raise UnsupportedModelError(f"no_rope_layers has {len(rope_layers)} entries for {config.num_layers} layers")
    return replace(config, rope_layers=rope_layers, sliding_window=None, layer_windows=windows)


def read_gguf_config(meta: dict[str, Any], arch: str, vocab_rows: int) -> ModelConfig:
    """SmolLM3's `smollm3.*` metadata: the Llama shape, the no-RoPE interval as llama.cpp fixes it."""
    config = gguf_config(meta, arch, vocab_rows)
    return replace(config, rope_layers=no_rope_every(GGUF_NO_ROPE_INTERVAL, config.num_layers))


FAMILY = ModelFamily(llama.LlamaForCausalLM, read_hf_config, read_gguf_config, llama.GGUF_LAYER_TENSORS)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("SmolLM3ForCausalLM", HF, FAMILY),
    Architecture("smollm3", GGUF, FAMILY, gguf_permuted_qk=True),  # converted as a Llama: Q/K permuted
)
