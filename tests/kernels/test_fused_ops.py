"""The fused per-layer ops (C++) against their torch definitions, on rows as the model hands them over."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import ops
from kvserve.kernels.build import cpu_kernels
from kvserve.kernels.ops import apply_rope

KERNEL = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the C++ kernels could not be built here: torch runs instead")


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_its_residual_add(rows):
    x, delta, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    torch.testing.assert_close(KERNEL.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    residual = x.clone()
    normed = KERNEL.add_rms_norm_(residual, delta, weight, 1e-6)
    torch.testing.assert_close(residual, x + delta)  # updated in place
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (576,), weight, 1e-6))
    # a strided view (a row slice of a wider tensor) is read where it lies
    wide = torch.randn(rows, 700)
    torch.testing.assert_close(KERNEL.rms_norm(wide[:, :576], weight, 1e-5),
                               F.rms_norm(wide[:, :576], (576,), weight, 1e-5))


@pytest.mark.parametrize("rows", [1, 5])
def test_rope_rotates_q_and_k_of_a_fused_qkv_in_place(rows):
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    positions = torch.arange(100, 100 + rows).float()
    freqs = positions[:, None] / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rope(q.reshape(rows, heads, head_dim), cos, sin)
    expected_k = apply_rope(k.reshape(rows, kv_heads, head_dim), cos, sin)
    expected_v = v.clone()
    KERNEL.rope_(qkv, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(q.reshape(rows, heads, head_dim), expected_q)
    torch.testing.assert_close(k.reshape(rows, kv_heads, head_dim), expected_k)
    assert torch.equal(v, expected_v)  # V is not rotated


@pytest.mark.parametrize("activation", [ops.SILU, ops.GELU_TANH])
def test_gated_activations(activation):
    x = torch.randn(4, 2 * 1536) * 3
    gate, up = x.chunk(2, dim=-1)
    act = F.silu(gate) if activation == ops.SILU else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(KERNEL.gated_activation(x, activation), act * up, rtol=1e-5, atol=1e-5)


def test_the_torch_fallbacks_agree_with_the_kernel(monkeypatch):
    x, delta, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    cos, sin = torch.randn(3, 16), torch.randn(3, 16)
    qkv = torch.randn(3, 6 * 16)
    with_kernel = (ops.rms_norm(x, weight, 1e-6), ops.add_rms_norm_(x.clone(), delta, weight, 1e-6),
                   ops.gated_activation(qkv, ops.SILU))
    rotated = qkv.clone()
    ops.rope_(rotated, cos, sin, 4, 16)
    from kvserve.kernels import build

    monkeypatch.setitem(build._state, "module", None)
    without = (ops.rms_norm(x, weight, 1e-6), ops.add_rms_norm_(x.clone(), delta, weight, 1e-6),
               ops.gated_activation(qkv, ops.SILU))
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b)
    fallback = qkv.clone()
    ops.rope_(fallback, cos, sin, 4, 16)
    torch.testing.assert_close(rotated, fallback)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_casts_and_scatters_both_sides(dtype):
    qkv = torch.randn(5, (4 + 2 * 2) * 16)  # K and V as the strided views of a fused QKV output
    k = qkv[:, 64:96].view(5, 2, 16)
    v = qkv[:, 96:].view(5, 2, 16)
    k_cache, v_cache = torch.zeros(40, 16, dtype=dtype), torch.zeros(40, 16, dtype=dtype)
    slots = torch.randperm(40)[:10]
    KERNEL.store_kv_(k_cache, v_cache, slots, k, v)
    expected_k, expected_v = torch.zeros(40, 16, dtype=dtype), torch.zeros(40, 16, dtype=dtype)
    expected_k.index_copy_(0, slots, k.reshape(-1, 16).to(dtype))
    expected_v.index_copy_(0, slots, v.reshape(-1, 16).to(dtype))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        KERNEL.store_kv_(k_cache, v_cache, slots + 40, k, v)
