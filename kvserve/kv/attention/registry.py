"""Attention backends by name (`EngineConfig.attention_backend`)."""

from __future__ import annotations

from kvserve.errors import ConfigError
from kvserve.kv.attention.base import AttentionBackend
from kvserve.kv.attention.cpu import CpuAttentionBackend, TorchCpuAttentionBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (CpuAttentionBackend, TorchCpuAttentionBackend)
}
# What `auto` picks on each device type the model can run on.
_AUTO_BY_DEVICE = {"cpu": CpuAttentionBackend.name}


def attention_backend_names() -> list[str]:
    return ["auto", *ATTENTION_BACKENDS]


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """The backend called `name`; `auto` is the one for `device` (the model's device type)."""
    if name == "auto":
        if device not in _AUTO_BY_DEVICE:
            raise ConfigError(f"no attention backend runs on device {device!r}; "
                             f"backends exist for: {', '.join(_AUTO_BY_DEVICE)}")
        name = _AUTO_BY_DEVICE[device]
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of: {', '.join(attention_backend_names())}")
    return backend()
