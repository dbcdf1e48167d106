"""Full attention's block tables: every query reads every block, so a table keeps them all."""

from __future__ import annotations

from kvserve.arith import cdiv
from kvserve.kv.groups.group_manager import BlockLookup, GroupManager


class FullAttentionManager(GroupManager):
    def first_needed_block(self, position: int) -> int:
        return 0

    def longest_hit(self, lookup: BlockLookup, num_blocks: int) -> int:
        """A hit needs the whole chain: it ends at the first block not cached."""
        run = 0
        while run < num_blocks and lookup(run) is not None:
            run += 1
        return run

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        return cdiv(num_tokens, self.block_size)
