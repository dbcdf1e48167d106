"""Attention backends by name: `auto`, known names, and clear errors for the rest."""

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.kv.attention import CpuAttentionBackend, attention_backend_names, get_attention_backend


def test_auto_picks_cpu_on_cpu():
    assert type(get_attention_backend("auto")) is CpuAttentionBackend
    assert type(get_attention_backend("cpu")) is CpuAttentionBackend
    assert get_attention_backend("cpu-torch").decode_kernel is None
    assert attention_backend_names() == ["auto", "cpu", "cpu-torch"]


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; choose one of: auto, cpu"):
        get_attention_backend("flash")


def test_auto_on_a_device_without_a_backend_is_named():
    with pytest.raises(ValueError, match="no attention backend runs on device 'mps'"):
        get_attention_backend("auto", device="mps")


def test_engine_config_checks_the_name_and_the_engine_resolves_it_before_loading():
    with pytest.raises(ValueError, match="attention_backend must be a backend name"):
        EngineConfig(attention_backend="")
    # Raised before any model is loaded (no model is given or loaded here).
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        Engine(EngineConfig(attention_backend="flash"))
