"""EngineConfig's field metadata: one checker for Python and the command line, flags built from it."""

import argparse
import dataclasses

import pytest

from kvserve.config import EngineConfig
from kvserve.config_fields import ConfigFieldError, flag_names
from kvserve.engine_args import add_engine_args, engine_config_from_args


def test_every_field_with_a_flag_is_a_flag_with_its_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    flags = flag_names(EngineConfig)
    assert flags["enable_kv_cache"] == "--no-kv-cache" and flags["block_size"] == "--block-size"
    assert flags["device"] == "--device"  # cpu today; the engine refuses others before the load
    assert engine_config_from_args(args) == EngineConfig()
    args = parser.parse_args(["--no-kv-cache", "--no-prefix-caching", "--allow-kv-overcommit", "--block-size", "8",
                              "--max-pinned-fraction", "0.25", "--kv-cache-memory", "2GiB"])
    config = engine_config_from_args(args)
    assert not config.enable_kv_cache and not config.enable_prefix_caching and config.allow_kv_overcommit
    assert (config.block_size, config.max_pinned_fraction, config.kv_cache_memory) == (8, 0.25, "2GiB")


def test_a_field_error_names_the_field_in_python_and_the_flag_on_the_command_line():
    with pytest.raises(ConfigFieldError, match="max_num_seqs must be a positive integer, got 0") as info:
        EngineConfig(max_num_seqs=0)
    assert info.value.field == "max_num_seqs"
    assert info.value.for_flag("--max-num-seqs") == "--max-num-seqs must be >= 1, got 0"
    with pytest.raises(ConfigFieldError, match="max_pinned_fraction must be between 0 and 1, got 1.5"):
        EngineConfig(max_pinned_fraction=1.5)


def test_choices_come_from_the_metadata_and_the_registries():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    choices = {action.dest: action.choices for action in parser._actions}
    assert choices["weights_dtype"] == ("auto", "float32", "bfloat16", "int8", "int4")
    assert choices["context_overflow"] == ("error", "shift")
    assert choices["attention_backend"] == ("auto", "cpu", "cpu-torch")
    assert choices["kv_cache_dtype"] is None  # aliases and K/V pairs are accepted too: kv/cache/kv_spec.py checks it
    helps = {action.dest: action.help for action in parser._actions}
    assert "auto follows --weights-dtype" in helps["kv_cache_dtype"] and "fp8_e5m2" in helps["kv_cache_dtype"]
    assert all("{" not in text for text in helps.values() if text)
    assert [f.name for f in dataclasses.fields(EngineConfig) if "help" not in f.metadata] == []
