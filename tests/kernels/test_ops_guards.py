"""kernels/ops.py, the one door to the C++ extension: a tensor it cannot take is refused by name (or takes the
torch path where there is one), never handed to the kernel."""

import pytest
import torch

from kvserve.kernels import ops
from kvserve.kernels.packing import pack, quantize_groups

needs_kernels = pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")


@needs_kernels
def test_quant_matmul_refuses_a_tensor_off_the_cpu_or_of_another_dtype():
    packed = pack(quantize_groups(torch.randn(16, 64), 4))
    with pytest.raises(ops.KernelInputError, match="quant_matmul: x is on meta; the C\\+\\+ kernel reads CPU"):
        ops.quant_matmul(torch.empty(2, 64, device="meta"), packed, 4, 16)
    with pytest.raises(ops.KernelInputError, match="quant_matmul: x is bfloat16, expected float32"):
        ops.quant_matmul(torch.randn(2, 64, dtype=torch.bfloat16), packed, 4, 16)
    with pytest.raises(ops.KernelInputError, match="packed is float32, expected uint8"):
        ops.quant_matmul(torch.randn(2, 64), packed.float(), 4, 16)


@needs_kernels
def test_paged_decode_refuses_a_quantized_cache_or_misplaced_metadata():
    q = torch.randn(1, 4, 16)
    cache = torch.zeros(4, 2, 4, 16)
    rows = ops.RowTables(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))
    assert ops.paged_decode(q, cache, cache, rows, 0.25, 1).shape == (1, 64)
    int8_cache = cache.to(torch.int8)
    with pytest.raises(ops.KernelInputError, match="k_cache is int8, expected float32, float16, bfloat16"):
        ops.paged_decode(q, int8_cache, int8_cache, rows, 0.25, 1)
    with pytest.raises(ops.KernelInputError, match="tables is on meta"):
        ops.paged_decode(q, cache, cache, rows._replace(tables=rows.tables.to("meta")), 0.25, 1)
    with pytest.raises(ops.KernelInputError, match="row_pos is int32, expected int64"):
        ops.paged_decode(q, cache, cache, rows._replace(row_pos=rows.row_pos.int()), 0.25, 1)
    with pytest.raises(RuntimeError, match="reads outside its table"):  # the kernel checks what it will read
        ops.paged_decode(q, cache, cache, rows._replace(row_pos=torch.tensor([4])), 0.25, 1)


@needs_kernels
def test_paged_decode_quant_refuses_float_parameters_or_misplaced_open_blocks():
    q = torch.randn(1, 4, 16)
    data, params = torch.zeros(4, 2, 4, 8, dtype=torch.uint8), torch.zeros(4, 2, 4, 8, dtype=torch.float16)
    rows = ops.RowTables(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))
    side = (data, params, ops.INT4_CHANNEL)
    assert ops.paged_decode_quant(q, side, (data, params[..., :2].contiguous(), ops.INT4_ROW), 16, None, rows,
                                  0.25, 1).shape == (1, 64)
    with pytest.raises(ops.KernelInputError, match="k_params is float32, expected float16"):
        ops.paged_decode_quant(q, (data, params.float(), ops.INT4_CHANNEL), side, 16, None, rows, 0.25, 1)
    open_blocks = (torch.zeros(1, 2, 4, 16, dtype=torch.float16, device="meta"),) * 2 + (torch.full((4,), -1),)
    with pytest.raises(ops.KernelInputError, match="CPU tensors only"):
        ops.paged_decode_quant(q, side, side, 16, open_blocks, rows, 0.25, 1)


def test_kernels_without_a_torch_path_say_so_where_none_are_built(monkeypatch):
    from kvserve.kernels import build

    monkeypatch.setitem(build._state, "module", None)
    assert not ops.available() and ops.quant_matmul_isa() is None
    with pytest.raises(ops.KernelInputError, match="quant_matmul needs kvserve's C\\+\\+ kernels"):
        ops.quant_matmul(torch.randn(1, 32), torch.zeros(1, 1, 1, dtype=torch.uint8), 4, 16)


def test_the_fused_ops_take_the_torch_path_for_tensors_the_kernel_cannot_take():
    # A device other than the CPU (meta stands in for a GPU here) or another dtype: torch, not the kernel.
    x, weight = torch.randn(3, 64), torch.randn(64)
    expected = torch.nn.functional.rms_norm(x, (64,), weight, 1e-6)
    assert ops.rms_norm(x.to("meta"), weight.to("meta"), 1e-6).device.type == "meta"
    torch.testing.assert_close(ops.rms_norm(x.double(), weight.double(), 1e-6).float(), expected)
    assert ops.gated_activation(torch.empty(2, 8, device="meta"), ops.SILU).shape == (2, 4)
    k = torch.randn(2, 1, 16)
    assert not ops.store_kv_(torch.zeros(4, 16, device="meta"), torch.zeros(4, 16, device="meta"),
                             torch.tensor([0, 1]), k, k)  # the pool's torch path writes it instead
    assert not ops.store_kv_(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 16, dtype=torch.int8),
                             torch.tensor([0, 1]), k, k)
