"""A single request's KV cache, stored contiguously per layer.

This is the foundation's cache: one request, K and V rows for positions
0..num_tokens-1 in every layer. The paged block pool (issue 3) replaces it for
batched serving; the model sees either only through `store`.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.kv.spec import KVSpec, kv_spec, torch_cache_dtype


class ContiguousKVCache:
    """K/V for one sequence: per layer a `[num_kv_heads, capacity, head_dim]` tensor.

    `reserve` sizes it up front (prompt + max_tokens, like a contiguous
    per-request allocation in a non-paged engine); it grows by doubling only if
    a caller goes past what it reserved.
    """

    def __init__(self, config: ModelConfig, dtype: str = "auto", capacity: int = 0) -> None:
        self.spec: KVSpec = kv_spec(config, dtype)
        self._torch_dtype = torch_cache_dtype(dtype)
        self.num_tokens = 0
        self.capacity = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        if capacity:
            self.reserve(capacity)

    @property
    def bytes_allocated(self) -> int:
        return self.capacity * self.spec.bytes_per_token

    def reserve(self, num_tokens: int) -> None:
        """Make room for at least `num_tokens` positions, keeping what is stored."""
        if num_tokens <= self.capacity:
            return
        new_capacity = max(num_tokens, 2 * self.capacity)
        shape = (self.spec.num_kv_heads, new_capacity, self.spec.head_dim)
        for layer in range(self.spec.num_layers):
            k = torch.empty(shape, dtype=self._torch_dtype)
            v = torch.empty(shape, dtype=self._torch_dtype)
            if self.num_tokens:
                k[:, : self.num_tokens] = self._k[layer][:, : self.num_tokens]
                v[:, : self.num_tokens] = self._v[layer][:, : self.num_tokens]
            if layer < len(self._k):
                self._k[layer], self._v[layer] = k, v
            else:
                self._k.append(k)
                self._v.append(v)
        self.capacity = new_capacity

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V `[num_kv_heads, T, head_dim]` at positions start..start+T-1 of `layer`.

        Returns views of every stored position 0..start+T-1 (no copy).
        """
        end = start + k.shape[1]
        self._k[layer][:, start:end] = k
        self._v[layer][:, start:end] = v
        return self._k[layer][:, :end], self._v[layer][:, :end]
