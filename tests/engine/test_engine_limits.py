"""Engine construction checks: the context limit and the KV budget, for the CLI and the offline API alike."""

import logging

import pytest

from kvserve.config import EngineConfig
from kvserve.errors import ConfigError, KVServeError
from tests.engine.test_engine import make_engine


def test_config_error_is_a_kvserve_error_and_a_value_error():
    with pytest.raises(ConfigError, match="max_model_len must be a positive integer, got 0") as info:
        EngineConfig(max_model_len=0)
    assert isinstance(info.value, KVServeError) and isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match="kv_cache_memory: cannot read 'lots'"):
        EngineConfig(kv_cache_memory="lots")


def test_max_model_len_within_the_context_is_used(tiny_models):
    assert make_engine(tiny_models(), max_model_len=100).max_model_len == 100
    assert make_engine(tiny_models()).max_model_len == 256


def test_max_model_len_beyond_the_context_is_refused_without_rope_scaling(tiny_models):
    with pytest.raises(ConfigError, match="max_model_len 100,000 is beyond the model's context of 256 tokens"):
        make_engine(tiny_models(), max_model_len=100_000)


def test_max_model_len_beyond_the_context_is_allowed_with_rope_scaling(tiny_models, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.setup"):
        engine = make_engine(tiny_models("llama-linear-rope"), max_model_len=1000)
    assert engine.max_model_len == 1000
    assert "max_model_len 1,000 is beyond the model's context of 256 tokens" in caplog.text
    assert "RoPE scaling (linear, factor 4)" in caplog.text


def test_a_kv_budget_above_available_memory_is_refused_unless_overcommit_is_allowed(tiny_models, monkeypatch,
                                                                                     caplog):
    monkeypatch.setattr("kvserve.engine.setup.available_memory", lambda: 2**20)
    with pytest.raises(ConfigError) as info:
        make_engine(tiny_models(), kv_cache_memory="2MiB")
    message = str(info.value)
    assert "2.00 MiB (2,097,152 bytes) is larger than the memory available, 1.00 MiB (1,048,576 bytes" in message
    assert "--allow-kv-overcommit" in message

    with caplog.at_level(logging.WARNING, logger="kvserve.engine.setup"):
        engine = make_engine(tiny_models(), kv_cache_memory="2MiB", allow_kv_overcommit=True)
    assert engine.kv_cache.bytes_allocated <= 2 * 2**20
    assert "2,097,152 bytes) is larger than the memory available" in caplog.text
    assert "allowed by --allow-kv-overcommit" in caplog.text
