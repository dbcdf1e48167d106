"""Shared layers: fused linear weight loaders write the right rows; the linear method is swappable."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import RopeScaling
from kvserve.model.layers import (
    Linear,
    LinearMethod,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    WeightShapeError,
    copy_checked,
    new_parameter,
    rope_inv_freq,
)


def load(layer: Linear, name: str, value: torch.Tensor, shard=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, value, shard)


def test_qkv_loader_writes_each_shard_into_its_rows():
    layer = QKVLinear(hidden_size=6, head_dim=2, num_heads=4, num_kv_heads=1, bias=True)
    sizes = {"q": 8, "k": 2, "v": 2}
    # Loaded out of order, each shard a distinct constant: a wrong offset shows up as a wrong value.
    for shard, value in (("v", 3.0), ("q", 1.0), ("k", 2.0)):
        load(layer, "weight", torch.full((sizes[shard], 6), value), shard)
        load(layer, "bias", torch.full((sizes[shard],), -value), shard)
    expected_rows = torch.tensor([1.0] * 8 + [2.0] * 2 + [3.0] * 2)
    assert torch.equal(layer.weight, expected_rows[:, None].expand(12, 6))
    assert torch.equal(layer.bias, -expected_rows)


def test_merged_loader_rows_and_shard_checks():
    layer = MergedLinear(4, [3, 5])
    gate, up = torch.randn(3, 4), torch.randn(5, 4)
    load(layer, "weight", up, 1)
    load(layer, "weight", gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="shards 0..1"):
        load(layer, "weight", gate, 2)
    with pytest.raises(WeightShapeError) as info:
        load(layer, "weight", torch.zeros(5, 4), 0)
    assert (info.value.actual, info.value.expected) == ((5, 4), (3, 4))
    with pytest.raises(ValueError, match="shards q, k, v"):
        load(QKVLinear(4, 2, 2, 1), "weight", torch.zeros(4, 4), 0)
    with pytest.raises(ValueError, match="no shards"):
        load(Linear(4, 3), "weight", torch.zeros(3, 4), 0)


def test_a_shape_only_shard_is_checked_and_writes_nothing():
    # A GGUF K-quant matrix comes to its layer as a meta tensor: the layer will hold the file's codes.
    layer = MergedLinear(4, [3, 5])
    layer.weight.data.fill_(1.5)
    load(layer, "weight", torch.empty(5, 4, device="meta"), 1)
    assert torch.equal(layer.weight, torch.full((8, 4), 1.5))
    with pytest.raises(WeightShapeError):
        load(layer, "weight", torch.empty(5, 4, device="meta"), 0)
    with pytest.raises(NotImplementedError):  # where nothing else holds the weight, a shape is never taken
        copy_checked(torch.zeros(3, 4), torch.empty(3, 4, device="meta"))


def test_fp32_linear_is_exactly_f_linear():
    layer = Linear(5, 3, bias=True)
    weight, bias = torch.randn(3, 5), torch.randn(3)
    load(layer, "weight", weight)
    load(layer, "bias", bias)
    x = torch.randn(4, 5)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert layer.weight.dtype == torch.float32 and not layer.weight.requires_grad


class BFloat16Method(LinearMethod):
    """A stand-in for a quantized format: weights held in bf16, multiplied in fp32."""

    def create_weights(self, layer, input_size, output_size, bias):
        layer.weight = new_parameter(output_size, input_size, dtype=torch.bfloat16, weight_loader=None)
        layer.bias = new_parameter(output_size, weight_loader=None) if bias else None

    def load(self, layer, param, loaded, rows):
        copy_checked(param.data[rows], loaded)

    def apply(self, layer, x):
        return F.linear(x, layer.weight.float(), layer.bias)


def test_linear_method_swap_changes_storage_not_the_loader():
    layer = MergedLinear(4, [2, 2], bias=True)
    layer.set_method(BFloat16Method())
    assert layer.weight.dtype == torch.bfloat16 and dict(layer.named_parameters()).keys() == {"weight", "bias"}
    weight = torch.randn(4, 4)
    load(layer, "weight", weight[:2], 0)
    load(layer, "weight", weight[2:], 1)
    load(layer, "bias", torch.zeros(2), 0)
    load(layer, "bias", torch.zeros(2), 1)
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, weight.bfloat16().float()))


def test_rms_norm_and_rotary():
    norm = RMSNorm(8, 1e-6)
    norm.weight.weight_loader(norm.weight, torch.arange(8.0))
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), torch.arange(8.0), 1e-6))  # the C++ op: one pass
    residual, delta = x.clone(), torch.randn(3, 8)
    torch.testing.assert_close(norm.add_and_norm(residual, delta), F.rms_norm(x + delta, (8,), torch.arange(8.0), 1e-6))
    torch.testing.assert_close(residual, x + delta)

    rotary = RotaryEmbedding(head_dim=8, theta=10000.0, scaling=RopeScaling("linear", factor=4.0))
    base = rope_inv_freq(8, 10000.0)
    assert torch.equal(rotary.inv_freq, base / 4.0)
    cos, sin = rotary(torch.tensor([0, 5]))
    assert cos.shape == (2, 8) and torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    divisors = torch.tensor([1.0, 2.0, 4.0, 8.0])
    rotary.load_freq_divisors(divisors)  # GGUF rope_freqs replaces the config's scaling
    assert torch.equal(rotary.inv_freq, base / divisors)


def test_rotary_tables_are_each_position_times_each_frequency_and_follow_a_new_inv_freq():
    rotary = RotaryEmbedding(head_dim=64, theta=10000.0)

    def expected(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * rotary.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    for positions in (torch.arange(0, 3000), torch.tensor([600]), torch.tensor([2**24 - 1, 3, 99999])):
        for got, want in zip(rotary.rotation(positions), expected(positions)):
            assert torch.equal(got, want)  # bit for bit: the step's tables are what they were
    rotary.load_freq_divisors(torch.linspace(1.0, 8.0, 32))  # a GGUF's rope_freqs replaces inv_freq
    for got, want in zip(rotary(torch.tensor([7, 4096])), expected(torch.tensor([7, 4096]))):
        assert torch.equal(got, want)


def test_rotary_tables_are_real_on_a_meta_build():
    with torch.device("meta"):
        rotary = RotaryEmbedding(head_dim=8, theta=10000.0)
        layer = Linear(4, 2)
    assert rotary.inv_freq.device.type == "cpu" and layer.weight.is_meta
