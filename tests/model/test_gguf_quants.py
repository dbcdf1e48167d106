"""Our torch dequantizers against the gguf package's independent numpy implementation."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize

from kvserve.errors import UnsupportedModelError
from kvserve.model.gguf_quants import SUPPORTED_TYPES, codes_held_exactly, dequantize, group_codes

# Byte offsets of the fp16 scale fields in each block, which must hold finite
# values (random bytes would give NaN/inf scales that compare unequal).
_FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def _random_blocks(type_name: str, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[type_name]:
        scales = rng.uniform(-2, 2, size=num_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return raw


@pytest.mark.parametrize("type_name", sorted(_FP16_FIELDS))
def test_quantized_types_match_gguf_reference(type_name):
    rng = np.random.default_rng(0)
    block_elems, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rows = 6
    raw = _random_blocks(type_name, rows * 2, rng).reshape(rows, -1)
    expected = reference_dequantize(raw, gguf.GGMLQuantizationType[type_name])
    ours = dequantize(raw, type_name, (rows, 2 * block_elems))
    assert ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantize_roundtrip_through_our_decoder(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    weights = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    packed = gguf.quants.quantize(weights, qtype)
    ours = dequantize(packed, type_name, (8, 64)).numpy()
    np.testing.assert_allclose(ours, reference_dequantize(packed, qtype), rtol=1e-6, atol=1e-6)
    # and it is a faithful approximation of the original (about half a quantization step)
    bound = {"4": 0.3, "5": 0.15, "8": 0.03}[type_name[1]]
    assert np.abs(ours - weights).max() < bound


@pytest.mark.parametrize("type_name,np_dtype", [("F32", np.float32), ("F16", np.float16)])
def test_float_types(type_name, np_dtype):
    values = np.random.default_rng(2).standard_normal((3, 5)).astype(np_dtype)
    np.testing.assert_array_equal(dequantize(values, type_name, (3, 5)).numpy(), values.astype(np.float32))


def test_bf16():
    values = torch.randn(4, 6)
    as_bf16 = values.to(torch.bfloat16)
    raw = as_bf16.view(torch.int16).numpy()
    assert torch.equal(dequantize(raw, "BF16", (4, 6)), as_bf16.float())


def test_unsupported_type_is_named():
    with pytest.raises(UnsupportedModelError, match="IQ2_XS is not supported"):
        dequantize(np.zeros(10, dtype=np.uint8), "IQ2_XS", (10,))


def test_supported_types_cover_the_issue_list():
    assert set(SUPPORTED_TYPES) >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}


def test_mxfp4_matches_gguf_reference_and_roundtrips():
    """gpt-oss's expert type: every code, exponents across the range (0 and 1 take ggml's subnormal branch)."""
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, size=(64, 17), dtype=np.uint8)
    raw[:, 0] = np.concatenate([[0, 1, 2, 127], rng.integers(90, 160, size=60)]).astype(np.uint8)
    expected = reference_dequantize(raw.reshape(4, -1), gguf.GGMLQuantizationType.MXFP4)
    ours = dequantize(raw.reshape(4, -1), "MXFP4", (4, 16 * 32))
    np.testing.assert_array_equal(ours.numpy(), expected)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    packed = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.MXFP4)
    assert packed.shape == (8, 2 * 17)
    decoded = dequantize(packed, "MXFP4", (8, 64)).numpy()
    np.testing.assert_array_equal(decoded, reference_dequantize(packed, gguf.GGMLQuantizationType.MXFP4))
    assert np.abs(decoded - weights).max() < 1.0  # 4-bit E2M1: steps of up to a third of the block's top


def test_mxfp4_as_group_codes_is_exactly_the_files_weights():
    """gpt-oss's experts held as the file's 4-bit codes and a table of their levels (doubled E2M1 value + 12),
    scale 2^(e - 128), offset -12 scale: every weight bit-equal to the file's, the same as 8-bit codes; an
    exponent outside fp16's exact range gives None."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(8 * 4, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(104, 141, size=len(raw))
    raw[:2, 0] = (104, 140)
    codes = group_codes(raw.reshape(-1), "MXFP4", (8, 4 * 32))
    assert codes is not None and codes.bits == 4 and codes.table is not None and int(codes.table.max()) == 24
    expected = dequantize(raw.reshape(-1), "MXFP4", (8, 4 * 32))
    assert torch.equal(codes.dequantize(), expected)
    assert torch.equal(codes.untabled().dequantize(), expected) and codes.untabled().bits == 8
    for exponent in (103, 141, 0):
        raw[5, 0] = exponent
        assert group_codes(raw.reshape(-1), "MXFP4", (8, 4 * 32)) is None


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_codes_held_exactly_is_whether_group_codes_gives_the_files_weights(type_name):
    """What lets a loader skip a matrix's fp32 says yes exactly where `group_codes` gives every weight: a
    centred type's offset (-8d, -16d, -128d) that overflows fp16 in one block makes both say no."""
    raw = _random_blocks(type_name, 8 * 4, np.random.default_rng(4))
    shape = (8, 4 * 32)
    codes = group_codes(raw.reshape(-1), type_name, shape)
    assert codes_held_exactly(raw.reshape(-1), type_name, shape) and codes is not None
    assert torch.equal(codes.dequantize(), dequantize(raw.reshape(-1), type_name, shape))
    raw[5, 0:2] = np.array([9000.0], dtype=np.float16).view(np.uint8)  # d: 8d, 16d, 128d overflow fp16
    held = codes_held_exactly(raw.reshape(-1), type_name, shape)
    assert held == (group_codes(raw.reshape(-1), type_name, shape) is not None)
    assert held == (type_name in ("Q4_1", "Q5_1"))  # these store their offset: any fp16 scale fits


def test_codes_held_exactly_of_other_types_and_shapes():
    rng = np.random.default_rng(5)
    assert codes_held_exactly(_random_blocks("Q4_K", 2, rng).reshape(-1), "Q4_K", (2, 256))
    assert not codes_held_exactly(np.zeros(2 * 32, dtype=np.float32), "F32", (2, 32))
    assert not codes_held_exactly(np.zeros(2 * 32, dtype=np.float16), "F16", (2, 32))
    assert not codes_held_exactly(_random_blocks("Q8_0", 2, rng).reshape(-1), "Q8_0", (64,))  # not a matrix
