"""cos / sin of RoPE by position, computed once per position and kept: a step looks its positions up.

A decode step made its tables anew from its positions (a product, a cos and a sin: three ops, ~55 us of a
~4 ms SmolLM2 step, with the weights just through the caches). Here two lookups take their place.

A position's entry is computed the way a step computed it (its position times each frequency, in fp32, then
cos and sin), in a fixed chunk of positions that nothing recomputes: the table grows by appending chunks. So
an entry's bits never depend on which positions a step asked for, or when (torch's cos may take another
path for a tensor's last few elements; a chunk's elements, and their order, are always the same).
"""

from __future__ import annotations

import torch

CHUNK_POSITIONS = 1024  # positions computed together; the table grows by whole chunks
DEFAULT_LIMIT = 1 << 17  # positions a table may hold when the model states no context


class RopeTable:
    """cos, sin `[T, dim]` at positions `[T]` for frequencies `doubled` `[dim]` (each angle twice), times
    `factor`. It holds positions 0 .. n in whole chunks, n at least the furthest position asked for; positions
    below 0 or from `limit` on (a context shift's rotation, a position past the model's context) are computed
    as they come, with the same ops, and not kept."""

    def __init__(self, doubled: torch.Tensor, factor: float, limit: int | None) -> None:
        self.doubled = doubled
        self.factor = factor
        self.limit = max(limit or DEFAULT_LIMIT, CHUNK_POSITIONS)
        self.cos = self.sin = doubled.new_empty(0, doubled.numel())
        self._grow_to(CHUNK_POSITIONS)  # never empty: index_select on an empty table is another error

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        except IndexError:  # not held yet: grow the table to them, or compute them where it cannot hold them
            pass
        if positions.numel() == 0:
            return self.compute(positions)
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= self.limit:
            return self.compute(positions)
        self._grow_to(high + 1)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of a pure rotation by `positions` (any sign, no factor), computed now: each position times
        each frequency (one product op), then its cos and sin."""
        emb = torch.outer(positions, self.doubled)
        return emb.cos(), emb.sin()

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries for `positions`, computed now (what a chunk does): the rotation times the factor."""
        cos, sin = self.rotation(positions)
        if self.factor == 1.0:
            return cos, sin
        return cos * self.factor, sin * self.factor

    def _grow_to(self, count: int) -> None:
        held = self.cos.shape[0]
        # At least doubled (within the limit): a long generation copies the table a few times, not once a chunk.
        wanted = max(count, min(2 * held, self.limit))
        end = -(-wanted // CHUNK_POSITIONS) * CHUNK_POSITIONS
        chunks = [self.compute(torch.arange(start, start + CHUNK_POSITIONS, device=self.doubled.device))
                  for start in range(held, end, CHUNK_POSITIONS)]
        # The old entries are copied, never recomputed.
        self.cos = torch.cat([self.cos, *(cos for cos, _ in chunks)])
        self.sin = torch.cat([self.sin, *(sin for _, sin in chunks)])
