"""Attention over a compressed prefix: new tokens attend over each KV head's kept prompt tokens and themselves.

Heads keep different tokens, so the mask is by position per KV head (`[KVH, N, P + N]`); every head keeps the same
count, so K/V stay one tensor. Kept keys are used as they are: RoPE rotated them at their original positions and a
query at position p scores them by p - position, as it would have uncompressed.

Without a sliding window every kept token precedes every new one and the mask is the same for every head: then
it is the very mask `reference.attend` builds, and with nothing dropped the result is the same bits as attention
over the uncompressed prefix (the same SDPA call on the same tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvserve.kv.attention.base import AttentionContext, KeysFromValues
from kvserve.kv.attention.reference import masked_attention, with_sinks
from kvserve.kv.compression.select import CompressedKV


def kept_mask(key_positions: torch.Tensor, q_positions: torch.Tensor,
              sliding_window: int | None) -> torch.Tensor:
    """Key positions `[KVH, L]`, query positions `[N]` -> `[KVH, N, L]` (True = attend)."""
    distance = q_positions[None, :, None] - key_positions[:, None, :]
    mask = distance >= 0
    if sliding_window is not None:
        mask &= distance < sliding_window
    return mask


def attend_kept(q: torch.Tensor, q_positions: torch.Tensor, prefix: CompressedKV, k: torch.Tensor,
                v: torch.Tensor, scale: float, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[H, N, D]` at `q_positions` `[N]` (after every kept token), new k/v `[KVH, N, D]` -> `[N, H * D]`."""
    heads, num_queries, _ = q.shape
    kv_heads = k.shape[0]
    keys = torch.cat([prefix.keys.to(k.dtype), k], dim=1)
    values = torch.cat([prefix.values.to(v.dtype), v], dim=1)
    key_positions = torch.cat([prefix.positions, q_positions.expand(kv_heads, -1)], dim=1)
    mask = kept_mask(key_positions, q_positions, sliding_window)
    if bool((mask == mask[:1]).all()):
        mask = mask[0]  # one mask for every head: reference.attend's own, and SDPA's broadcast
        per_head = mask
    else:
        per_head = mask.repeat_interleave(heads // kv_heads, dim=0)  # [H, N, L] for SDPA's query heads
    if sinks is not None:
        grouped = mask if mask.dim() == 2 else mask[:, None]  # masked_attention's [KVH, G, N, L] scores
        out, lse = masked_attention(q, keys, values, grouped, scale)
        return with_sinks(out, lse, sinks).transpose(0, 1).reshape(num_queries, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=per_head, scale=scale, enable_gqa=heads != kv_heads)
    return out[0].transpose(0, 1).reshape(num_queries, -1)


class CompressedPrefixContext(AttentionContext):
    """A forward's new tokens (one sequence, at `positions` right after the prompt) over each layer's compressed
    prompt (`prefixes[layer]`), nothing stored: what a paged backend will do with packed kept blocks, in torch."""

    def __init__(self, positions: torch.Tensor, prefixes: Sequence[CompressedKV],
                 layer_windows: Sequence[int | None]) -> None:
        self.positions = positions
        self.prefixes = prefixes
        self.layer_windows = layer_windows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
               sinks: torch.Tensor | None = None, keys_from_values: KeysFromValues | None = None) -> torch.Tensor:
        if v is None:
            raise ValueError("a layer reading another layer's K/V is not supported over a compressed prefix yet")
        if k is None:
            if keys_from_values is None:
                raise ValueError("a layer without keys passes its values and keys_from_values (K = V)")
            k = keys_from_values(v, self.positions)
        return attend_kept(q.transpose(0, 1), self.positions, self.prefixes[layer], k.transpose(0, 1),
                           v.transpose(0, 1), scale, self.layer_windows[layer], sinks)
