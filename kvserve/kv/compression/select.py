"""From scores to kept tokens, and from kept tokens to the compressed K/V a cache would hold.

Deterministic: the same scores give the same indices bit for bit. Ties go to the earlier token (a stable
sort), so the kept set never depends on how a sort kernel orders equal values; the scorers are plain
float32 torch ops, the same bits for the same keys on the same build and thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.compression.scoring import SCORERS, PromptKV
from kvserve.kv.compression.spec import CompressionSpec


@dataclass(frozen=True, slots=True)
class CompressedKV:
    """One layer's kept tokens per KV head: keys/values `[KVH, K, D]`, their original positions `[KVH, K]` and
    indices into the prompt `[KVH, K]` (ascending per head). Keys stay rotated at their original positions."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    indices: torch.Tensor

    @property
    def num_kept(self) -> int:
        return self.keys.shape[1]


def protected_mask(num_tokens: int, budget: int, sinks: int, window: int) -> torch.Tensor:
    """`[T]` True for the tokens every method keeps: the first `sinks`, then the last `window`, cut to `budget`."""
    sinks = min(sinks, budget)
    window = min(window, budget - sinks)
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[:sinks] = True
    if window:
        mask[num_tokens - window :] = True
    return mask


def keep_indices(scores: torch.Tensor, spec: CompressionSpec) -> torch.Tensor:
    """Scores `[KVH, T]` (higher kept) -> indices `[KVH, K]`, ascending, K = spec.budget(T) for every head."""
    return keep_top(scores, spec.budget(scores.shape[1]), spec.sinks, spec.window)


def keep_top(scores: torch.Tensor, budget: int, sinks: int, window: int) -> torch.Tensor:
    """Scores `[KVH, T]` -> the `budget` best per head, ascending, the first `sinks` and last `window` always
    among them (cut to the budget, sinks first). The engine's chunks call it with their whole-block budget."""
    heads, length = scores.shape
    if budget >= length:
        return torch.arange(length).expand(heads, length).clone()
    if not torch.isfinite(scores).all():
        raise ValueError("KV compression scores must be finite")
    protected = protected_mask(length, budget, sinks, window)
    ranked = scores.float().masked_fill(protected, float("inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # ties: the earlier token first
    return order[:, :budget].sort(dim=-1).values


def gather_kept(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                indices: torch.Tensor) -> CompressedKV:
    """K/V `[KVH, T, D]` at positions `[T]`, kept `indices` `[KVH, K]` -> the compressed layer."""
    rows = indices[..., None].expand(-1, -1, keys.shape[-1])
    return CompressedKV(keys.gather(1, rows), values.gather(1, rows), positions[indices], indices)


def compress_layer(kv: PromptKV, spec: CompressionSpec) -> CompressedKV:
    """One layer's prompt K/V compressed by `spec` (auto resolved to its method)."""
    spec = spec.resolve()
    if spec.budget(kv.keys.shape[1]) == kv.keys.shape[1]:
        indices = torch.arange(kv.keys.shape[1]).expand(kv.keys.shape[0], -1).clone()
    else:
        indices = keep_indices(SCORERS[spec.method](kv), spec)
    return gather_kept(kv.keys, kv.values, kv.positions, indices)
