"""Per-request block tables over the block pool.

The scheduler asks only yes/no questions (`allocate_slots`, `can_fit`) and
never sees a block; the runner gets block ids to address the paged tensors.
"""

from __future__ import annotations

from collections import Counter

from kvserve.kv.block_pool import BlockPool, KVBlock


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Admissions keep this many blocks free, so running requests can grow
        # a little before anyone has to be preempted.
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 and num_blocks > 1 else 0
        self._tables: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` could ever fit, with the whole pool to itself."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def allocate_slots(self, request_id: str, num_tokens: int, keep_watermark: bool = False) -> bool:
        """Make the request's table cover `num_tokens` tokens; False (and nothing changes) if blocks run out."""
        table = self._tables.setdefault(request_id, [])
        needed = self.blocks_for(num_tokens) - len(table)
        if needed <= 0:
            return True
        reserve = self.watermark_blocks if keep_watermark else 0
        if needed > self.num_free_blocks - reserve:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks (tail first). Freeing an unknown id is a no-op."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def check_integrity(self) -> None:
        """free + used == total; every held block's ref_cnt equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = Counter(block.block_id for table in self._tables.values() for block in table)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} tables"
            )
        assert self.num_free_blocks + len(holders) == self.num_blocks
