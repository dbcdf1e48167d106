"""The contiguous backend: the forward's tokens are one whole sequence that attends over its own K/V.

Nothing is stored, so there is no cache layout, batch order or block
metadata to own: the context is all there is. The model uses it when its
forward gets no context (tests, perplexity scripts); subclasses may replace
`attend_sequence` to study the attention math (bench/int4_variants.py reads
K/V back as a quantized cache would give them).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.kv.attention.base import AttentionContext, KeysFromValues
from kvserve.kv.attention.reference import attend


class ContiguousContext(AttentionContext):
    """`positions` `[N]` (0..N-1: the whole sequence); `layer_windows[i]` = layer i's window (None = full);
    `kv_sources[i]`: the layer whose K/V layer i reads (ModelConfig.kv_source_layers; None: its own)."""

    def __init__(self, positions: torch.Tensor, layer_windows: Sequence[int | None],
                 kv_sources: Sequence[int] | None = None) -> None:
        if positions.numel() == 0 or int(positions[0]) != 0:
            raise ValueError("without a KV cache the input must be the whole sequence")
        self.positions = positions
        self.layer_windows = layer_windows
        self.kv_sources = kv_sources
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a source layer's K/V, for its readers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
               sinks: torch.Tensor | None = None, keys_from_values: KeysFromValues | None = None) -> torch.Tensor:
        source = layer if self.kv_sources is None else self.kv_sources[layer]
        if source != layer:
            if k is not None or v is not None:
                raise ValueError(f"layer {layer} reads layer {source}'s K/V: it passes none of its own")
            k, v = self._kept[source]
        else:
            if k is None:
                if keys_from_values is None or v is None:
                    raise ValueError("a layer without keys passes its values and keys_from_values (K = V)")
                k = keys_from_values(v, self.positions)
            if self.kv_sources is not None:
                self._kept[layer] = (k, v)
        args = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, self.layer_windows[layer])
        # Sinks only where the model has them: a subclass that studies plain attention need not take them.
        return self.attend_sequence(*args) if sinks is None else self.attend_sequence(*args, sinks=sinks)

    def attend_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        sliding_window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q `[H, N, D]`, k/v `[KVH, N, D]` of one layer -> `[N, H * D]`; `sinks` `[H]` (reference.py)."""
        return attend(q, k, v, self.positions, scale, sliding_window, sinks=sinks)
