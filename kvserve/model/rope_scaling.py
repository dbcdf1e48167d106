"""RoPE frequency scalings that stretch a model past the context it was trained on, each as Hugging Face
computes it (transformers' modeling_rope_utils is the reference for the bits): inverse frequencies, and the
factor cos and sin are multiplied by.

- YaRN (Ministral 3): the fast-rotating dimensions keep their frequency (extrapolate), the slow ones are
  divided by `factor` (interpolate), a linear ramp blends the band between (beta_fast..beta_slow rotations
  over the original context); cos and sin are multiplied by an "mscale" that grows with log(factor).
- LongRoPE (Phi-3, Phi-4-mini): each frequency divided by its own factor, `long_factor` when the context is
  longer than the original one and `short_factor` otherwise; cos and sin multiplied by
  sqrt(1 + log(factor) / log(original context)).

transformers picks LongRoPE's set per forward call from the longest position in it. Here the set is fixed
by the context the model runs with (llama.cpp's rule): a key's rotation must not depend on how long the
request it was first computed for was, or a cached prefix would change the answer.
"""

from __future__ import annotations

import math

import torch

from kvserve.config import RopeScaling


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by (1.0 for the scalings that do not scale them)."""
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling.mscale and scaling.mscale_all_dim:
        return float(_mscale(factor, scaling.mscale) / _mscale(factor, scaling.mscale_all_dim))
    return _mscale(factor)


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies `[dim / 2]` for `dim` rotated channels."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a band of no width: keep the ramp finite
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    position_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolated = 1.0 / position_freqs
    interpolated = 1.0 / (scaling.factor * position_freqs)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def uses_long_factor(scaling: RopeScaling, context_length: int) -> bool:
    """Whether LongRoPE runs with its long set for a model whose context is `context_length` tokens."""
    return context_length > scaling.original_max_position_embeddings


def longrope_inv_freq(dim: int, theta: float, scaling: RopeScaling, context_length: int) -> torch.Tensor:
    """LongRoPE's inverse frequencies `[dim / 2]` for a model whose context is `context_length` tokens."""
    factors = scaling.long_factor if uses_long_factor(scaling, context_length) else scaling.short_factor
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if not factors:  # a GGUF file's come as tensors, after the model is built: plain RoPE until then
        return 1.0 / (theta**exponents)
    if len(factors) != dim // 2:
        raise ValueError(f"LongRoPE has {len(factors)} factors for {dim // 2} frequencies")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponents)
