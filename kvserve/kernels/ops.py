"""The per-layer ops the model families call: the C++ kernel where it is built, torch where it is not.

Both give the same math in fp32 (the tests hold them to each other); the
kernel does each in one pass over its rows instead of a chain of dispatched
torch ops, which is most of a batch-1 decode step's overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.build import cpu_kernels as kernels  # the compiled kernels, or None

SILU, GELU_TANH = 0, 1  # gated_activation's activations (the C++ enum)


def _rows(x: torch.Tensor) -> bool:
    """Whether the kernel takes x as it is: fp32 rows with a contiguous last dimension."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[T, H]` / rms(x) * weight."""
    ext = kernels()
    if ext is not None and _rows(x):
        return ext.rms_norm(x, weight, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place); returns rms_norm(residual)."""
    ext = kernels()
    if ext is not None and _rows(residual) and _rows(delta):
        return ext.add_rms_norm_(residual, delta, weight, eps)
    residual.add_(delta)
    return F.rms_norm(residual, residual.shape[-1:], weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row of x `[T, >= heads * head_dim]`
    (a fused QKV output's Q and K lie side by side); cos, sin `[T, head_dim]`."""
    ext = kernels()
    if ext is not None and _rows(x):
        ext.rope_(x, cos, sin, heads, head_dim)
        return
    rotated = x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)
    rotated.copy_(apply_rope(rotated, cos, sin))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, D]` (rotate-half layout, as in Hugging Face); a new tensor."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> bool:
    """New tokens' K, V `[T, KVH, D]` (fp32) into float cache rows `[rows, D]` at `slots` (`[T * KVH]`), cast
    to the cache's dtype, in one pass; False (nothing written) where the kernel is not built."""
    ext = kernels()
    if ext is None or k.dtype != torch.float32 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    ext.store_kv_(k_cache, v_cache, slots, k, v)
    return True


def gated_activation(x: torch.Tensor, activation: int) -> torch.Tensor:
    """x `[T, 2I]` (gate, then up) -> act(gate) * up `[T, I]`; SILU or GELU_TANH."""
    ext = kernels()
    if ext is not None and _rows(x):
        return ext.gated_activation(x, activation)
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) if activation == SILU else F.gelu(gate, approximate="tanh")) * up
