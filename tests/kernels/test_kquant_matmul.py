"""The C++ K-quant matmul (Q4_K, Q5_K, Q6_K super-blocks held exactly) on every instruction-set path against
the file's weights dequantized by gguf_quants, with the activations rounded to int8 as the kernel does (one
scale per ACTIVATION_BLOCK inputs)."""

import numpy as np
import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.kquant_packing import (ACTIVATION_BLOCK, KQUANT_KINDS, TYPE_BYTES, KQuantCodes,
                                            kquant_packed_bytes, pack_kquant, pack_kquant_reference)
from kvserve.model.gguf_quants import dequantize
from tests.helpers import int8_activation_matmul

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
RUNNABLE = list(ISAS)[: ISAS[ops.quant_matmul_isa()] + 1] if ops.available() else []


def random_kquant(kind: str, rows: int, cols: int, seed: int) -> KQuantCodes:
    """Random super-blocks: every code, scale and min byte random, d and dmin small finite fp16 values."""
    gen = torch.Generator().manual_seed(seed)
    supers = cols // 256
    blocks = torch.randint(0, 256, (rows * supers, TYPE_BYTES[kind]), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(rows * supers, 2, generator=gen) * 1e-3).half().view(torch.uint8)
    if kind == "Q6_K":
        blocks[:, 208:210] = scale[:, 0:2]
    else:
        blocks[:, 0:4] = scale
    return KQuantCodes(kind, blocks.view(rows, supers, TYPE_BYTES[kind]))


def dequantized(codes: KQuantCodes) -> torch.Tensor:
    return dequantize(codes.blocks.numpy().reshape(-1), codes.kind, codes.shape)


@pytest.mark.parametrize("kind", list(KQUANT_KINDS))
@pytest.mark.parametrize("rows,supers", [(1, 1), (16, 2), (37, 3)])
def test_the_cpp_repack_writes_the_torch_references_bytes(kind, rows, supers):
    # Every byte of the file's blocks random (top bits, signed Q6_K scales), a last tile of padding rows.
    codes = random_kquant(kind, rows, 256 * supers, 7 * rows + supers + KQUANT_KINDS[kind])
    packed = ops.kquant_repack(codes.blocks, KQUANT_KINDS[kind])
    assert packed.shape == (-(-rows // 16), supers, kquant_packed_bytes(16, 256, kind))
    assert torch.equal(packed, pack_kquant_reference(codes))
    assert torch.equal(pack_kquant(codes), packed)  # what the layers load with, where the kernels are built


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kind", list(KQUANT_KINDS))
@pytest.mark.parametrize("rows,cols,outputs", [(1, 256, 16), (1, 512, 33), (3, 768, 17), (9, 256, 50),
                                               (64, 512, 40)])
def test_each_path_computes_the_dequantized_product(isa, kind, rows, cols, outputs):
    seed = rows * 1000 + cols + outputs + KQUANT_KINDS[kind]
    codes = random_kquant(kind, outputs, cols, seed)
    packed = pack_kquant(codes)
    assert packed.numel() == kquant_packed_bytes(outputs, cols, kind)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[0, :ACTIVATION_BLOCK] = 0  # an all-zero block of activations (scale 0) adds nothing, never a NaN
    y = ops.kquant_matmul(x, packed, KQUANT_KINDS[kind], outputs, isa=ISAS[isa])
    expected = int8_activation_matmul(x, dequantized(codes), group=ACTIVATION_BLOCK)
    assert y.shape == (rows, outputs) and y.dtype == torch.float32
    # The integer dot products are exact; what differs is fp32 rounding of the per-group sums.
    assert (y.double() - expected).abs().max() <= 2e-5 * max(float(expected.abs().max()), 1.0)
    alone = ops.kquant_matmul(x[-1:], packed, KQUANT_KINDS[kind], outputs, isa=ISAS[isa])
    assert torch.equal(alone[0], y[-1])


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kind", list(KQUANT_KINDS))
def test_extreme_codes_and_scales_are_exact(isa, kind):
    # Every code at its top and every scale at its extreme (6-bit 63, Q6_K's -128): no saturation on AVX2's
    # 16-bit pair sums, no sign slip in Q6_K's signed scales.
    codes = random_kquant(kind, 16, 256, 7)
    blocks = codes.blocks.view(16, TYPE_BYTES[kind])
    if kind == "Q6_K":
        blocks[:, 0:192] = 0xFF
        blocks[:, 192:208] = 0x80
    else:
        blocks[:, 4:TYPE_BYTES[kind]] = 0xFF
    x = torch.tensor([[127.0] * 256, [-127.0] * 256, [1.0, -1.0] * 128])
    y = ops.kquant_matmul(x, pack_kquant(codes), KQUANT_KINDS[kind], 16, isa=ISAS[isa])
    expected = int8_activation_matmul(x, dequantized(codes), group=ACTIVATION_BLOCK)
    assert (y.double() - expected).abs().max() <= 1e-5 * float(expected.abs().max())


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("rows", [1, 5, 19])
def test_parts_in_one_call_write_their_own_columns_as_separate_calls_do(isa, rows):
    # A fused projection's parts of unequal tile counts (3, 1 and 2 tiles: each thread takes the same share
    # of every part), each of its own kind, from one quantization of x.
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    codes = [random_kquant("Q4_K", 48, 512, 1), random_kquant("Q6_K", 16, 512, 2), random_kquant("Q5_K", 20, 512, 4)]
    parts = [ops.KQuantPart(pack_kquant(c), KQUANT_KINDS[c.kind], column, c.shape[0])
             for c, column in zip(codes, (0, 48, 70))]
    out = torch.full((rows, 96), 7.0)
    assert ops.kquant_matmul_parts(x, parts, out, isa=ISAS[isa]) is out
    for part in parts:
        alone = ops.kquant_matmul(x, part.packed, part.kind, part.outputs, isa=ISAS[isa])
        assert torch.equal(out[:, part.column : part.column + part.outputs], alone)
    assert torch.equal(out[:, 64:70], torch.full((rows, 6), 7.0))  # nothing between or past the parts' columns
    assert torch.equal(out[:, 90:], torch.full((rows, 6), 7.0))


def test_mismatched_shapes_and_kinds_are_refused():
    packed = pack_kquant(random_kquant("Q4_K", 16, 256, 3))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.kquant_matmul(torch.randn(2, 512), packed, KQUANT_KINDS["Q4_K"], 16)
    with pytest.raises(RuntimeError, match="do not match"):  # a Q4_K tile read as Q6_K
        ops.kquant_matmul(torch.randn(2, 256), packed, KQUANT_KINDS["Q6_K"], 16)
    with pytest.raises(RuntimeError, match="kind must be"):
        ops.kquant_matmul(torch.randn(2, 256), packed, 5, 16)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.kquant_matmul(torch.randn(2, 256), packed, KQUANT_KINDS["Q4_K"], 16, out=torch.empty(2, 8))
    with pytest.raises(ops.KernelInputError, match="x is float64"):
        ops.kquant_matmul(torch.randn(2, 256, dtype=torch.float64), packed, KQUANT_KINDS["Q4_K"], 16)


def test_unpacked_fields_match_the_gguf_package():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    for kind in KQUANT_KINDS:
        codes = random_kquant(kind, 4, 512, 11)
        raw = codes.blocks.numpy().reshape(4, -1)
        theirs = gguf_quants.dequantize(raw, GGMLQuantizationType[kind])
        np.testing.assert_allclose(dequantized(codes).numpy(), theirs, rtol=1e-6, atol=1e-7)
