"""One KV group's block tables: the part of the KV manager that depends on the attention kind.

vLLM's SingleTypeKVCacheManager: the coordinator (kv/manager.py) holds one
manager per KV group (kv/groups/layout.py) and loops over them; each answers for its
own kind of attention (kv/groups/full.py, kv/groups/window.py) how long a prefix hit it can
serve, which blocks a request no longer reads, and what its tables must hold.
Every group of a request has a table of the same length (but where KV compression
dropped tokens from a full-attention group's table: kv/compressed_tables.py); a
position whose block was freed behind a window holds None (the null block).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from kvserve.errors import KVIntegrityError
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import KVBlock

BlockTable = list[KVBlock | None]
# (table index) -> the cached block for that index of the request's chain in this group, if any
BlockLookup = Callable[[int], KVBlock | None]


class GroupManager(ABC):
    """The tables of one KV group, over the shared pool."""

    window: int | None = None  # the sliding window of the group's layers (None: full attention)
    keeps_whole_chains = True  # every block of a request's chain stays in its table while it runs

    def __init__(self, pool: BlockPool, block_size: int, group: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group = group
        self.tables: dict[str, BlockTable] = {}

    @abstractmethod
    def first_needed_block(self, position: int) -> int:
        """The first table index a query at `position` reads."""

    @abstractmethod
    def longest_hit(self, lookup: BlockLookup, num_blocks: int) -> int:
        """The most blocks, at most `num_blocks`, of a hit this group can serve: never more, and the
        coordinator asks again with the smaller answer until every group agrees."""

    @abstractmethod
    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int | None) -> int:
        """The most blocks this group holds at once for a request of `num_tokens` tokens."""

    def free_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Free blocks no later query of the request reads; how many. Full attention reads them all."""
        return 0

    def resumable_tokens(self, request_id: str, num_tokens: int) -> int:
        """The most tokens, at most `num_tokens`, whose K/V a request cut back to `num_tokens` keeps usable:
        a cut inside a block other requests share stops at that block's start (its rows after the cut would
        be rewritten under them)."""
        index = num_tokens // self.block_size
        if num_tokens % self.block_size:
            block = self.tables[request_id][index]
            if block is not None and block.ref_cnt > 1:
                return index * self.block_size
        return num_tokens

    def start(self, request_id: str, table: Sequence[KVBlock | None]) -> None:
        """A request's first table (empty, or a prefix hit's blocks, already referenced)."""
        self.tables[request_id] = list(table)

    def extend(self, request_id: str, blocks: Sequence[KVBlock]) -> None:
        self.tables[request_id].extend(blocks)

    def cut(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        """Cut the table back to `num_tokens` tokens; the blocks dropped from it (not yet freed). A cached
        block the cut falls inside leaves the cache: its rows after the cut are about to be rewritten."""
        table = self.tables.get(request_id)
        if not table:
            return []
        index = num_tokens // self.block_size
        if num_tokens % self.block_size:
            block = table[index]
            if block is not None and block.block_hash is not None:
                self.pool.uncache(block)
            index += 1
        dropped = [block for block in table[index:] if block is not None]
        del table[index:]
        return dropped

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first: chain ends are evicted before their roots."""
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.free(block for block in reversed(table) if block is not None)

    def check_table(self, request_id: str, num_computed_tokens: int) -> None:
        """Raise KVIntegrityError if the table lost a block the request's next query reads."""
        table = self.tables.get(request_id, ())
        if any(block is None for block in table[self.first_needed_block(num_computed_tokens):]):
            raise KVIntegrityError(f"request {request_id}: group {self.group} lost a block its next query reads")
