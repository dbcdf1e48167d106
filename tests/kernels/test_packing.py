"""Group codes: quantizing fp32 weights, reading a GGUF file's own blocks exactly, the packed layout."""

import numpy as np
import pytest
import torch

from kvserve.kernels.packing import GroupCodes, block_bytes, pack, packed_bytes, quantize_groups, zero_point
from kvserve.model.gguf_quants import dequantize, group_codes, kquant_codes


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_keeps_each_weight_within_half_a_step(bits):
    weight = torch.randn(40, 96)
    codes = quantize_groups(weight, bits)
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) < 2**bits
    step = codes.scales.float().repeat_interleave(32, dim=1)
    assert ((codes.dequantize() - weight).abs() <= step / 2 + 1e-3 * step).all()
    constant = quantize_groups(torch.full((2, 32), 0.25), bits)  # span 0: the offset is the value
    assert torch.equal(constant.dequantize(), torch.full((2, 32), 0.25))


@pytest.mark.parametrize("type_name,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 8), ("Q5_1", 8), ("Q8_0", 8)])
def test_a_gguf_files_blocks_are_held_exactly(type_name, bits):
    import gguf
    from gguf.quants import quantize

    weight = np.random.default_rng(0).standard_normal((20, 64)).astype(np.float32)
    raw = quantize(weight, gguf.GGMLQuantizationType[type_name])
    codes = group_codes(raw, type_name, (20, 64))
    assert codes is not None and codes.bits == bits
    # bit for bit what the dequantizer reads from the file
    assert torch.equal(codes.dequantize(), dequantize(raw, type_name, (20, 64)))


@pytest.mark.parametrize("type_name,zero", [("Q4_0", 8), ("Q4_1", None), ("Q5_0", 16), ("Q5_1", None), ("Q8_0", 128)])
def test_a_gguf_files_zero_point_is_found(type_name, zero):
    """The formats whose offset is -zero * d have that zero point (the matmul folds it into its integer dot
    products); those with a free offset (a min) have none, nor do weights quantized here."""
    import gguf
    from gguf.quants import quantize

    weight = np.random.default_rng(1).standard_normal((20, 64)).astype(np.float32)
    weight[3, :32] = 0  # a group of zeros: scale 0, which fits any zero point
    codes = group_codes(quantize(weight, gguf.GGMLQuantizationType[type_name]), type_name, (20, 64))
    assert zero_point(codes) == zero
    assert zero_point(quantize_groups(torch.from_numpy(weight), codes.bits)) is None
    all_zero = quantize_groups(torch.zeros(16, 32), 4)
    assert zero_point(all_zero) == 0


def test_k_quants_are_held_as_super_blocks_not_group_codes():
    # Q4_K's sub-block scales are d * a 6-bit integer: not an fp16 in general, so no group of fp16 scale and
    # offset holds them; the K-quant layers hold the file's super-blocks instead.
    raw = np.arange(4 * 144, dtype=np.uint8)
    assert group_codes(raw, "Q4_K", (4, 256)) is None
    held = kquant_codes(raw, "Q4_K", (4, 256))
    assert held.kind == "Q4_K" and held.shape == (4, 256)
    assert torch.equal(held.blocks.reshape(-1), torch.from_numpy(raw))  # the file's bytes as they are
    assert kquant_codes(raw[:4 * 18], "Q4_0", (4, 32)) is None


def test_the_packed_layout_puts_four_inputs_of_sixteen_rows_in_each_64_bytes():
    rows, cols = 20, 64
    codes = torch.arange(rows * cols).remainder(16).to(torch.uint8).view(rows, cols)
    weights = GroupCodes(codes, torch.rand(rows, 2).half(), torch.rand(rows, 2).half(), 4)
    packed = pack(weights)
    assert packed.shape == (2, 2, block_bytes(4)) and packed.numel() == packed_bytes(rows, cols, 4)
    # tile 1 (rows 16..19, then padding), group 1, vector 2: row r's inputs 8..11 (low) and 24..27 (high)
    vector = packed[1, 1, 128:192]
    for r in range(4):
        for i in range(4):
            byte = int(vector[4 * r + i])
            assert byte & 0x0F == int(codes[16 + r, 32 + 8 + i]) and byte >> 4 == int(codes[16 + r, 32 + 24 + i])
    assert not vector[16:].any()  # padded rows are zero
    scales = packed[1, 1, 256:288].view(torch.float16)
    assert torch.equal(scales[:4], weights.scales[16:, 1]) and not scales[4:].any()
