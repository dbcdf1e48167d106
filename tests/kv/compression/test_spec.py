"""CompressionSpec: parsing METHOD:RATIO, clear errors, budgets, `auto` resolved to the measured method."""

import pytest

from kvserve.kv.compression import AUTO_METHOD, METHODS, CompressionSpec, parse_compression


@pytest.mark.parametrize("text, method, ratio", [
    ("keydiff:2", "keydiff", 2.0), ("knorm:4", "knorm", 4.0), ("streaming:2", "streaming", 2.0),
    ("expected_attention:4", "expected_attention", 4.0), (" KeyDiff:1.5 ", "keydiff", 1.5), ("auto:2", "auto", 2.0),
])
def test_parses_method_and_ratio(text, method, ratio):
    spec = parse_compression(text)
    assert (spec.method, spec.ratio, spec.sinks, spec.window) == (method, ratio, 4, 64)


@pytest.mark.parametrize("text, message", [
    ("keydiff", "METHOD:RATIO"), (":2", "METHOD:RATIO"), ("keydiff:", "METHOD:RATIO"),
    ("snapkv:2", "unknown KV compression method 'snapkv'"), ("keydiff:two", "must be a number"),
    ("keydiff:0.5", ">= 1"), ("keydiff:nan", ">= 1"), ("keydiff:inf", ">= 1"),
])
def test_bad_input_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_compression(text)


def test_auto_resolves_to_the_measured_method():
    assert AUTO_METHOD in METHODS
    spec = parse_compression("auto:4")
    assert spec.resolve() == CompressionSpec(AUTO_METHOD, 4.0)
    assert spec.key() == spec.resolve().key() == f"{AUTO_METHOD}:4:s4:w64:c512"
    assert parse_compression("keydiff:2").resolve() == CompressionSpec("keydiff", 2)


def test_budget_is_ceil_of_tokens_over_ratio():
    assert CompressionSpec("knorm", 2).budget(2048) == 1024
    assert CompressionSpec("knorm", 4).budget(2049) == 513
    assert CompressionSpec("knorm", 3).budget(10) == 4
    assert CompressionSpec("knorm", 1).budget(7) == 7
    assert CompressionSpec("knorm", 1.5).budget(0) == 0
