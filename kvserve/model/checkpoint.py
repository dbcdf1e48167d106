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


def _rope(params: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling]:
    """(theta, scaling) from one set of RoPE parameters (`rope_parameters` or an older `rope_scaling`)."""
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
    if architectures and architectures[0] == "Gemma3ForConditionalGeneration":
        raise UnsupportedModelError(
            "Gemma3ForConditionalGeneration (the multimodal Gemma 3 checkpoints) is not supported: load a text-only "
            "checkpoint (Gemma3ForCausalLM: gemma-3-270m, gemma-3-1b) or a Gemma 3 GGUF file")
    arch = find_architecture(architectures[0] if architectures else None, HF).name
    if arch == "Gemma3ForCausalLM":
        return _gemma3_config(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    # transformers >= 5 writes `rope_parameters` (theta included); older
    # checkpoints write `rope_theta` + `rope_scaling`. Accept both.
    theta, scaling = _rope(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 10000.0))
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


# transformers' Gemma3TextConfig defaults, for the keys a config.json leaves out.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _gemma3_config(cfg: dict[str, Any]) -> ModelConfig:
    """A Gemma3ForCausalLM config.json (model_type gemma3_text)."""
    cfg = {**_GEMMA3_DEFAULTS, **{key: value for key, value in cfg.items() if value is not None}}
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=True (an embedding model) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg["sliding_window_pattern"])
    layer_types = cfg.get("layer_types") or [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 layer types {unknown} are not supported; supported: {_SLIDING}, {_FULL}")
    window = int(cfg["sliding_window"])
    # transformers >= 5 writes one `rope_parameters` set per layer type; older config.json files give the
    # global layers `rope_theta` + `rope_scaling` and the local ones `rope_local_base_freq`.
    params = cfg.get("rope_parameters") or {}
    if _FULL in params or _SLIDING in params:
        full, local = params.get(_FULL) or {}, params.get(_SLIDING) or {}
    else:
        full, local = cfg.get("rope_scaling") or {}, {"rope_theta": cfg["rope_local_base_freq"]}
    theta, scaling = _rope(full, cfg["rope_theta"])
    local_theta, local_scaling = _rope(local, cfg["rope_local_base_freq"])
    if local_scaling != RopeScaling():
        raise UnsupportedModelError(f"RoPE scaling on the sliding-window layers ({local_scaling.rope_type}) "
                                    "is not supported")
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg["head_dim"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        sliding_window=window,
        layer_windows=tuple(window if kind == _SLIDING else None for kind in layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=int(cfg["query_pre_attn_scalar"]),
        final_logit_softcapping=float(softcap) if softcap else None,
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
