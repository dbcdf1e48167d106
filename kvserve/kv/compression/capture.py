"""A prompt's per-layer K/V (and last queries) from one contiguous forward: what compression scores.

The engine will read these from its paged cache and its last prefill chunk; tests and bench/kv_compression.py
take them from a no-cache forward of the whole prompt.
"""

from __future__ import annotations

import torch

from kvserve.kv.attention.contiguous import ContiguousContext
from kvserve.kv.compression.scoring import PromptKV


class PromptCapture(ContiguousContext):
    """The contiguous context that also keeps, per layer, K/V `[KVH, T, D]` and the last `num_queries` queries
    `[H, W, D]`, as `PromptKV`s in `captured`."""

    def __init__(self, positions: torch.Tensor, layer_windows, num_queries: int = 256) -> None:
        super().__init__(positions, layer_windows)
        self.num_queries = num_queries
        self.captured: dict[int, PromptKV] = {}

    def attend_sequence(self, q, k, v, scale, sliding_window, sinks=None):
        layer = len(self.captured)  # layers attend in order, once each
        self.captured[layer] = PromptKV(k.clone(), v.clone(), self.positions,
                                        q[:, -self.num_queries :].clone(), scale)
        return super().attend_sequence(q, k, v, scale, sliding_window, sinks)

    def layers(self) -> list[PromptKV]:
        return [self.captured[i] for i in range(len(self.captured))]
