"""The C++ quantized matmul on every instruction-set path against the same math written in torch."""

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.packing import GROUP_SIZE, GroupCodes, pack, packed_bytes, quantize_groups, zero_point
from tests.helpers import int8_activation_matmul

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here (no compiler or "
                                                      "ninja): int8/int4 weights are refused without them")
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
# Each path this CPU can run: asking for a better one than it has runs its best instead.
RUNNABLE = list(ISAS)[: ISAS[ops.quant_matmul_isa()] + 1] if ops.available() else []


def reference(x: torch.Tensor, weight) -> torch.Tensor:
    return int8_activation_matmul(x, weight.dequantize())


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols,outputs", [(1, 32, 16), (1, 576, 960), (3, 64, 20), (8, 96, 33),
                                               (9, 128, 48), (37, 64, 17), (9, 128, 120)])
def test_each_path_computes_the_quantized_product(isa, bits, rows, cols, outputs):
    gen = torch.Generator().manual_seed(rows * 1000 + cols + bits)
    weights = quantize_groups(torch.randn(outputs, cols, generator=gen) * 0.05, bits)
    x = torch.randn(rows, cols, generator=gen)
    x[0, :GROUP_SIZE] = 0  # an all-zero group (scale 0) is a zero contribution, not a NaN
    y = ops.quant_matmul(x, pack(weights), bits, outputs, ISAS[isa])
    expected = reference(x, weights)
    assert y.shape == (rows, outputs) and y.dtype == torch.float32
    # The integer dot products are exact; what differs is fp32 rounding of the per-group sums.
    assert (y.double() - expected).abs().max() <= 1e-5 * max(float(expected.abs().max()), 1.0)
    # A row's result does not depend on the rows beside it (batch invariance).
    alone = ops.quant_matmul(x[-1:], pack(weights), bits, outputs, ISAS[isa])
    assert torch.equal(alone[0], y[-1])


ZERO_POINTS = {4: 8, 8: 128}  # GGUF Q4_0's and Q8_0's


def zero_point_codes(outputs: int, cols: int, bits: int, gen: torch.Generator) -> GroupCodes:
    """Codes as a GGUF Q4_0 / Q8_0 file holds them: every offset -zero * scale, exactly."""
    scales = (torch.rand(outputs, cols // GROUP_SIZE, generator=gen) * 0.01 + 1e-4).half()
    scales[0, 0] = 0  # a group of zeros: scale 0, offset 0
    codes = torch.randint(0, 2**bits, (outputs, cols), dtype=torch.uint8, generator=gen)
    return GroupCodes(codes, scales, (scales.float() * -ZERO_POINTS[bits]).half(), bits)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols,outputs", [(1, 32, 16), (1, 576, 960), (3, 64, 20), (9, 128, 120), (37, 64, 17)])
def test_a_zero_point_is_folded_into_the_dot_products(isa, bits, rows, cols, outputs):
    """Weights whose offsets are all -zero * scale (Q4_0, Q8_0) given their zero point: sum((q - zero) * xq)
    in integers, the offsets not read; the product the reference computes, a row alone as in its batch."""
    gen = torch.Generator().manual_seed(rows * 1000 + cols + bits)
    weights = zero_point_codes(outputs, cols, bits, gen)
    zero = ZERO_POINTS[bits]
    assert zero_point(weights) == zero
    x = torch.randn(rows, cols, generator=gen)
    if rows > 1:
        x[0, :GROUP_SIZE] = 0  # a group of zero activations (scale 0) beside others
    packed = pack(weights, offsets=False)
    assert packed.numel() == packed_bytes(outputs, cols, bits, offsets=False) < packed_bytes(outputs, cols, bits)
    y = ops.quant_matmul(x, packed, bits, outputs, ISAS[isa], zero=zero)
    expected = reference(x, weights)
    assert (y.double() - expected).abs().max() <= 1e-5 * max(float(expected.abs().max()), 1.0)
    assert torch.equal(ops.quant_matmul(x[-1:], packed, bits, outputs, ISAS[isa], zero=zero)[0], y[-1])
    # The zero point is what the kernel subtracts: another one is another product.
    assert not torch.allclose(ops.quant_matmul(x, packed, bits, outputs, ISAS[isa], zero=zero - 1), y)
    # The same codes with their offsets, read: the same product (up to fp32 rounding of the offset's term).
    with_offsets = ops.quant_matmul(x, pack(weights), bits, outputs, ISAS[isa])
    assert (with_offsets.double() - expected).abs().max() <= 1e-5 * max(float(expected.abs().max()), 1.0)


def test_a_zero_point_outside_a_byte_is_refused():
    packed = pack(quantize_groups(torch.randn(16, 64), 8), offsets=False)
    with pytest.raises(RuntimeError, match="zero is -1"):
        ops.quant_matmul(torch.randn(2, 64), packed, 8, 16, zero=256)


def test_blocks_with_and_without_offsets_are_told_apart():
    """A zero point goes with blocks that leave the offsets out, and none with blocks that hold them: the
    other way round, the kernel would read one block's bytes as another's."""
    codes = quantize_groups(torch.randn(16, 64), 4)
    with pytest.raises(RuntimeError, match="without offsets"):
        ops.quant_matmul(torch.randn(2, 64), pack(codes), 4, 16, zero=8)
    with pytest.raises(RuntimeError, match="with offsets"):
        ops.quant_matmul(torch.randn(2, 64), pack(codes, offsets=False), 4, 16)


def test_eight_bit_codes_use_their_whole_range():
    # Codes 0 and 255 against activations of both signs: the AVX2 path splits them into nibbles
    # (its byte multiply would saturate on 255 x 127 pairs).
    weights = quantize_groups(torch.tensor([[-1.0] * 16 + [1.0] * 16] * 16), 8)
    assert int(weights.codes.min()) == 0 and int(weights.codes.max()) == 255
    x = torch.tensor([[1.0, -1.0] * 16, [-3.0] * 32])
    for isa in RUNNABLE:
        y = ops.quant_matmul(x, pack(weights), 8, 16, ISAS[isa])
        torch.testing.assert_close(y, reference(x, weights).float(), rtol=1e-5, atol=1e-5)


MXFP4_LEVELS = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("table", ["mxfp4", "widest"])
@pytest.mark.parametrize("rows,cols,outputs", [(1, 32, 16), (1, 576, 960), (3, 64, 20), (9, 128, 48), (9, 128, 120)])
def test_four_bit_codes_through_a_table(isa, table, rows, cols, outputs):
    """4-bit codes standing for uneven levels (MXFP4's E2M1 values, doubled and shifted by 12; and the widest
    table the kernel takes, up to 127, where AVX2's byte multiply-add is nearest its saturation)."""
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    levels = MXFP4_LEVELS if table == "mxfp4" else torch.tensor([0, 127, 1, 126, 64, 3, 100, 7, 127, 0, 90, 45,
                                                                  12, 127, 33, 120], dtype=torch.uint8)
    scales = (torch.rand(outputs, cols // GROUP_SIZE, generator=gen) * 0.01).half()
    weights = GroupCodes(torch.randint(0, 16, (outputs, cols), dtype=torch.uint8, generator=gen), scales,
                         (scales.float() * -12).half(), 4, levels)
    x = torch.randn(rows, cols, generator=gen)
    x[0, -GROUP_SIZE:] = -127.0  # a group of the most negative activations: 127 x 127 pairs on AVX2
    y = ops.quant_matmul(x, pack(weights), 4, outputs, ISAS[isa], table=levels)
    expected = reference(x, weights)
    assert (y.double() - expected).abs().max() <= 1e-5 * max(float(expected.abs().max()), 1.0)
    alone = ops.quant_matmul(x[-1:], pack(weights), 4, outputs, ISAS[isa], table=levels)
    assert torch.equal(alone[0], y[-1])
    # Without the table the same bytes are other weights: the table is read, not ignored.
    assert not torch.allclose(ops.quant_matmul(x, pack(weights), 4, outputs, ISAS[isa]), y)


def test_a_bad_code_table_is_refused():
    packed = pack(quantize_groups(torch.randn(16, 64), 4))
    with pytest.raises(RuntimeError, match="below 128"):
        ops.quant_matmul(torch.randn(2, 64), packed, 4, 16, -1, table=torch.full((16,), 128, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="16 uint8 values"):
        ops.quant_matmul(torch.randn(2, 64), packed, 4, 16, -1, table=torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="16 uint8 values"):
        ops.quant_matmul(torch.randn(2, 64), pack(quantize_groups(torch.randn(16, 64), 8)), 8, 16, -1,
                         table=MXFP4_LEVELS)


def test_mismatched_shapes_are_refused():
    packed = pack(quantize_groups(torch.randn(16, 64), 4))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.quant_matmul(torch.randn(2, 96), packed, 4, 16, -1)
    with pytest.raises(RuntimeError, match="4 or 8 bits"):
        ops.quant_matmul(torch.randn(2, 64), packed, 5, 16, -1)
