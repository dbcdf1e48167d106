"""When the pool's blocks are zeroed: once each, before a step first uses it, and, while the server idles, ahead.

The pool is allocated uninitialized, on huge pages where the OS has them (kvserve/huge_pages.py), so nothing is
committed until it is written: the first write into each page faults it in, and the kernel clears it. Every
layer has its own tensor, and a new block's slices in all of them cross into fresh pages at the same block
id, so the step that first uses such a block paid for every layer's page at once: SmolLM2's 60 tensors, 120
MB of pages, 280-300 ms on this VM (whose host backs a page at its first touch; ~15 ms where it already has),
the first request's prefill included (its TTFT 594-682 ms against 345-380 ms on a pool zeroed before).

And a busy engine kept paying: the free queue hands out never-used blocks before it reuses any (LRU), so steps
fault fresh pages until the whole pool has been used once (SmolLM2's W1, 32 x (256 + 128) tokens on a 2 GiB
pool: 1.03-1.06x the time it took on the same pool committed first, three alternating pairs).

`BlockZeroing` keeps the watermark below which every block is zeroed in every tensor. `through` zeroes up to
a block a step is about to use (at least `chunk_blocks` at a time: one memset per tensor per chunk, as a fresh
pool hands blocks out in id order). `ahead` zeroes one piece beyond the watermark, one tensor's slice of up to
`lookahead_blocks` (a huge page's worth: milliseconds), up to the pool's end or that many blocks past the
highest block a step has asked for: the server's loop calls it while idle, so the pages later steps need are
committed before they run, as vLLM and llama.cpp commit their caches at startup. Only blocks at or above the
watermark are ever zeroed, and no step has written one of those (every writer asks `through` first), so
zeroing ahead never wipes K/V.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.huge_pages import HUGE_PAGE


def blocks_per_page(tensors: Sequence[torch.Tensor], minimum: int) -> int:
    """Blocks whose slices of the tensor with the most bytes per block fill one huge page (at least `minimum`)."""
    widest = max((t[0].numel() * t.element_size() for t in tensors), default=1)
    return max(minimum, HUGE_PAGE // max(1, widest))


class BlockZeroing:
    """Zeroes blocks [0, n) of `tensors` (each indexed by block id first) before first use, and ahead."""

    def __init__(self, tensors: Sequence[torch.Tensor], num_blocks: int, chunk_blocks: int,
                 lookahead_blocks: int) -> None:
        self.tensors = list(tensors)
        self.num_blocks = num_blocks
        self.chunk_blocks = chunk_blocks
        self.lookahead_blocks = lookahead_blocks
        self.zeroed_upto = 0  # blocks [0, zeroed_upto) are zeroed in every tensor
        self.used_upto = 0  # blocks [0, used_upto) have been asked for by `through`
        # The piece `ahead` is zeroing: blocks [zeroed_upto, _piece_end) of tensors [0, _next_tensor) are done.
        self._piece_end = 0
        self._next_tensor = 0

    def through(self, highest_block_id: int) -> None:
        """Make sure every block up to `highest_block_id` has been zeroed once before first use."""
        top = highest_block_id + 1
        self.used_upto = max(self.used_upto, top)
        if top <= self.zeroed_upto:
            return
        self._finish_piece()
        if top <= self.zeroed_upto:
            return
        end = min(self.num_blocks, max(top, self.zeroed_upto + self.chunk_blocks))
        for tensor in self.tensors:
            tensor[self.zeroed_upto : end].zero_()
        self.zeroed_upto = end

    def ahead(self, whole_pool: bool = False) -> bool:
        """Zero one piece (one tensor's slice) of the blocks up to the pool's end (`whole_pool`) or up to the
        lookahead past the used ones; whether any of those is left."""
        target = self.num_blocks if whole_pool else min(self.num_blocks, self.used_upto + self.lookahead_blocks)
        if self.zeroed_upto >= target or not self.tensors:
            return False
        if self._next_tensor == 0:
            self._piece_end = min(target, self.zeroed_upto + self.lookahead_blocks)
        self.tensors[self._next_tensor][self.zeroed_upto : self._piece_end].zero_()
        self._next_tensor += 1
        if self._next_tensor == len(self.tensors):
            self.zeroed_upto, self._next_tensor = self._piece_end, 0
        return self.zeroed_upto < target

    def _finish_piece(self) -> None:
        """A step needs blocks past the watermark: the piece `ahead` began is completed first."""
        if self._next_tensor == 0:
            return
        for tensor in self.tensors[self._next_tensor :]:
            tensor[self.zeroed_upto : self._piece_end].zero_()
        self.zeroed_upto, self._next_tensor = self._piece_end, 0
