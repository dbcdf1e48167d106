"""KV codecs: round-trip error bounds, saturation, zero rows, packing."""

import pytest
import torch

from kvserve.kv.cache.quant import CODECS, INT4_GROUP

ROWS, HEAD_DIM = 512, 64


def sample(seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HEAD_DIM, generator=gen)
    x[::7, 3] *= 40  # outlier channels, as real keys have
    x[::11] *= 1e-3  # tiny rows
    return x


def round_trip(name, x):
    codec = CODECS[name]
    data, params = codec.encode(x)
    return codec.decode(data, params, torch.float32), data, params


@pytest.mark.parametrize("name,relative", [
    ("float16", 2**-11), ("bfloat16", 2**-8),
    ("int8", 0.5 / 127 + 2**-10),  # half a step of absmax/127 (+ the fp16 scale's rounding)
    ("fp8_e4m3", 2**-4 + 2**-10), ("fp8_e5m2", 2**-3 + 2**-10),  # half an ulp at 3 / 2 mantissa bits
])
def test_scale_and_float_codecs_stay_within_their_bound(name, relative):
    x = sample()
    y, _, _ = round_trip(name, x)
    # Per row: error relative to the row's absmax (what one scale per row can promise).
    bound = relative * x.abs().amax(dim=-1, keepdim=True) + 1e-7
    err = (y - x).abs()
    if name.startswith("fp8") or name in ("float16", "bfloat16"):
        # floating formats: relative to each element (normal range), or the row bound for tiny ones
        bound = torch.maximum(relative * x.abs(), 2**-9 * x.abs().amax(dim=-1, keepdim=True)) + 1e-7
    assert (err <= bound).all(), float((err / bound).max())


def test_int4_error_is_half_a_step_of_each_group():
    x = sample()
    y, data, params = round_trip("int4", x)
    assert data.dtype == torch.uint8 and data.shape == (ROWS, HEAD_DIM // 2)
    assert params.shape == (ROWS, 2 * HEAD_DIM // INT4_GROUP)
    groups = x.view(ROWS, -1, INT4_GROUP)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    err = (y - x).abs().view(ROWS, -1, INT4_GROUP)
    # half a step, plus the fp16 rounding of scale and minimum (15 steps of scale error at the top)
    bound = step * (0.5 + 16 * 2**-10) + groups.abs().amax(-1, keepdim=True) * 2**-10 + 1e-6
    assert (err <= bound).all()


def test_int4_packs_even_channels_in_the_low_nibble():
    x = (torch.arange(64) % 16).float()[None, :]  # every group spans 0..15: step 1, minimum 0
    data, params = CODECS["int4"].encode(x)
    assert data[0, 0] == 0 | (1 << 4) and data[0, 1] == 2 | (3 << 4)
    q = torch.stack([data & 0xF, data >> 4], -1).reshape(1, 64)
    assert q.float().equal(x)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e4m3", "fp8_e5m2"])
def test_zero_rows_and_huge_values_decode_finite(name):
    x = torch.zeros(4, HEAD_DIM)
    x[1, 0] = 1e6  # far beyond fp8's range: saturates through the scale, never NaN/inf
    x[2] = -3e4
    y, _, _ = round_trip(name, x)
    assert torch.isfinite(y).all()
    assert y[0].eq(0).all() and y[3].eq(0).all()
    assert y[1, 0] == pytest.approx(1e6, rel=0.07)


def test_fp8_cast_is_clamped_before_it_can_overflow():
    codec = CODECS["fp8_e4m3"]
    data, scale = codec.encode(torch.tensor([[448.0, -448.0, 1.0, 0.0]]))
    assert torch.isfinite(data.float()).all() and data.float().abs().max() == 448
