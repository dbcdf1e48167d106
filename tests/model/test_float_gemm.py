"""fp32 linear layers give each row the same bits however many rows run (kvserve.model.float_gemm)."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.float_gemm import invariant_rows, row_invariant_linear

# The embedded model's shapes: fused QKV, O, gate/up, down, and its 49,152-token head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_a_row_alone_equals_it_in_a_batch_or_a_prefill_chunk(out_features, in_features, dtype):
    if invariant_rows(dtype) == 0:
        pytest.skip(f"this CPU's {dtype} GEMM is not row-invariant at any padding tried (logged; README)")
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(300, in_features, generator=gen).to(dtype)
    chunk = row_invariant_linear(x, weight, bias)
    for count in (1, 2, 3, 5, 7, 9, 17, 64):
        for start in (0, 11):
            rows = row_invariant_linear(x[start : start + count], weight, bias)
            assert torch.equal(rows, chunk[start : start + count]), f"{count} rows from {start}"


def test_padding_changes_no_value():
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(64, 32, generator=gen), torch.randn(3, 32, generator=gen)
    torch.testing.assert_close(row_invariant_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert row_invariant_linear(x, weight, None).shape == (3, 64)
