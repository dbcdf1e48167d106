"""Per-request block tables over the block pool, with prefix caching.

The scheduler asks only yes/no questions (`allocate_slots`, `can_fit`) and
gets opaque prefix matches; it never sees a block. The runner gets block ids
to address the paged tensors.

Prefix hashing (DESIGN §3, kv/hashing.py): a full block's hash chains its
parent block's hash and its token ids. The chain's root is derived from the
request's cache salt, so requests with different salts never share a block,
and a miss is only ever explained against the same salt's blocks. Each
request computes its chain once, as its tokens arrive (`BlockHashChain`);
the manager only indexes it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from kvserve.arith import cdiv
from kvserve.errors import KVIntegrityError
from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.hashing import BlockHash, BlockHashChain
from kvserve.kv.pins import PinStats, PinTable
from kvserve.kv.tier import BlockKey


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached blocks a request's tokens start with. Opaque to the scheduler."""

    blocks: tuple[KVBlock, ...]
    num_tokens: int
    last_hash: BlockHash  # hash of the last matched block (the chain root if none matched)
    num_tier_tokens: int = 0  # of num_tokens, those in blocks just loaded from a lower tier


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a request's tokens left the closest cached chain."""

    position: int  # index of the first token that differs from the closest cached block
    cached_token_ids: tuple[int, ...]  # that cached block's tokens (it starts at block_start)
    block_start: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, enable_caching: bool = False,
                 record_cached_blocks: bool = False, max_pinned_fraction: float = 0.5,
                 clock: Callable[[], float] | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # With a lower tier, blocks registered in the cache are also handed to the engine to write through.
        self._record_cached = record_cached_blocks
        self._newly_cached: list[tuple[int, BlockKey]] = []
        self.pool = BlockPool(num_blocks, block_size)
        # Per request: how many leading blocks of its table are registered in the cache (shared or cached).
        self._num_cached: dict[str, int] = {}
        # Admissions keep this many blocks free, so running requests can grow
        # a little before anyone has to be preempted.
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 and num_blocks > 1 else 0
        self._tables: dict[str, list[KVBlock]] = {}
        # Cache breakpoints with a TTL (kv/pins.py): evicted last, within a share of the pool.
        self.pins = PinTable(self.pool, int(max_pinned_fraction * num_blocks), clock)

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
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or free but not yet evicted)."""
        return len(self.pool.cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evicted only when handed out again)."""
        return self.pool.num_cached_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` could ever fit, with the whole pool to itself."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> PrefixMatch:
        """The longest chain of cached blocks `token_ids` (hashed as `block_hashes`) starts with.

        Capped at len(token_ids) - 1 tokens: at least one token is always
        computed, so there are logits to sample from.
        """
        if not self.enable_caching:
            return PrefixMatch((), 0, block_hashes.root)
        self._check_chain(block_hashes)
        bs, hashes = self.block_size, block_hashes.hashes
        parent, blocks = block_hashes.root, []
        for index in range(self._max_hit_blocks(token_ids, block_hashes)):
            block_hash = hashes[index]
            block = self.pool.lookup(block_hash, parent, token_ids[index * bs : (index + 1) * bs])
            if block is None:
                break
            blocks.append(block)
            parent = block_hash
        from_tier = sum(block.from_tier for block in blocks)
        return PrefixMatch(tuple(blocks), len(blocks) * bs, parent, from_tier * bs)

    def _max_hit_blocks(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> int:
        return min(len(block_hashes), (len(token_ids) - 1) // self.block_size)

    def keys_after(self, token_ids: Sequence[int], block_hashes: BlockHashChain, match: PrefixMatch) -> list[BlockKey]:
        """The keys of the blocks a hit could still cover after `match`: where a lower tier may continue it."""
        if not self.enable_caching:
            return []
        bs, hashes = self.block_size, block_hashes.hashes
        start = len(match.blocks)
        return [BlockKey(hashes[i], block_hashes.parent(i), tuple(token_ids[i * bs : (i + 1) * bs]))
                for i in range(start, self._max_hit_blocks(token_ids, block_hashes))]

    def room_for_loads(self, match: PrefixMatch) -> int:
        """How many blocks `adopt_loaded` could bring in after `match` now."""
        return self.num_free_blocks - sum(1 for block in match.blocks if block.ref_cnt == 0)

    def adopt_loaded(self, match: PrefixMatch, keys: Sequence[BlockKey],
                     fill: Callable[[list[int]], None]) -> int:
        """Bring blocks read from a lower tier into the pool as cached, free blocks continuing `match`.

        `fill(block_ids)` writes their K/V (the manager holds no tensors); only
        then are they registered under their keys, so a failed fill leaves no
        hashed block with unknown contents. The matched blocks are held meanwhile,
        so taking free blocks cannot evict them. Returns how many were adopted
        (0 if the free blocks do not suffice).
        """
        if not keys or len(keys) > self.room_for_loads(match):
            return 0
        self.pool.touch(match.blocks)
        fresh: list[KVBlock] = []
        try:
            fresh = self.pool.allocate(len(keys))
            fill([block.block_id for block in fresh])
            for block, key in zip(fresh, keys):
                # A key already cached in the pool (past a gap in the chain) keeps its pool copy.
                block.from_tier = self.pool.cache_block(block, key.block_hash, key.parent_hash, key.token_ids)
        finally:
            # Tail first, as a finished request frees: chain ends are evicted before their roots.
            self.pool.free(reversed(fresh))
            self.pool.free(reversed(match.blocks))
        return len(fresh)

    def take_cached_blocks(self) -> list[tuple[int, BlockKey]]:
        """(block id, key) of every block registered in the cache since the last call (with
        `record_cached_blocks`): what to write through to a lower tier. Read their contents before
        the next step can reuse them."""
        taken, self._newly_cached = self._newly_cached, []
        return taken

    def pending_block_keys(self, request_id: str, block_hashes: BlockHashChain, end: int) -> set[BlockHash]:
        """Hashes of the request's full blocks up to token `end` not yet computed: what it is about
        to compute and cache. Another request whose next block is among them need not compute it too."""
        if not self.enable_caching:
            return set()
        return set(block_hashes.hashes[self._num_cached.get(request_id, 0) : end // self.block_size])

    def next_block_key(self, token_ids: Sequence[int], block_hashes: BlockHashChain,
                       match: PrefixMatch) -> BlockHash | None:
        """Hash of the first block after `match`, if the tokens fill it and it is not the last token's block."""
        start, bs = match.num_tokens, self.block_size
        index = start // bs
        if not self.enable_caching or start + bs > len(token_ids) - 1 or index >= len(block_hashes):
            return None
        return block_hashes.hashes[index]

    def find_divergence(self, token_ids: Sequence[int], match: PrefixMatch) -> Divergence | None:
        """Compare the block after the match with every cached block that continues the same
        chain; the one sharing the most leading tokens says where `token_ids` diverged."""
        start = match.num_tokens
        ours = tuple(token_ids[start : start + self.block_size])
        best, best_common = None, -1
        for block in self.pool.children.get(match.last_hash, {}).values():
            common = 0
            while common < len(ours) and block.token_ids[common] == ours[common]:
                common += 1
            if common > best_common:
                best, best_common = block, common
        if best is None or best_common == len(ours):
            return None  # nothing cached continues this prefix, or the tokens ran out, not diverged
        return Divergence(start + best_common, best.token_ids, start)

    def allocate_slots(
        self, request_id: str, num_tokens: int, keep_watermark: bool = False, prefix: PrefixMatch | None = None
    ) -> bool:
        """Make the request's table cover `num_tokens` tokens; False (and nothing changes) if blocks run out.

        `prefix` (only for a request that holds no blocks) shares the matched
        cached blocks instead of allocating them.
        """
        table = self._tables.get(request_id, [])
        shared = list(prefix.blocks) if prefix is not None and not table else []
        needed = self.blocks_for(num_tokens) - len(table) - len(shared)
        # Shared blocks nobody holds are still in the free queue: taking them uses free blocks too.
        claimed = sum(1 for block in shared if block.ref_cnt == 0)
        reserve = self.watermark_blocks if keep_watermark else 0
        if max(needed, 0) + claimed > self.num_free_blocks - reserve:
            return False
        if shared:
            self.pins.refresh_hit(shared)  # a hit on a pinned prefix renews its TTL
            self.pool.touch(shared)
            for block in shared:
                block.from_tier = False  # counted as the tier's once, for this request
            self._num_cached[request_id] = len(shared)
        table = self._tables.setdefault(request_id, table)
        table.extend(shared)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], block_hashes: BlockHashChain,
                          num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full and computed, so later requests can share them."""
        if not self.enable_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        done = self._num_cached.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(table), len(block_hashes))
        if end <= done:
            return
        bs, hashes = self.block_size, block_hashes.hashes
        for index in range(done, end):
            chunk = tuple(token_ids[index * bs : (index + 1) * bs])
            parent = block_hashes.parent(index)
            if self.pool.cache_block(table[index], hashes[index], parent, chunk) and self._record_cached:
                self._newly_cached.append((table[index].block_id, BlockKey(hashes[index], parent, chunk)))
        self._num_cached[request_id] = end

    def pin(self, block_hashes: BlockHashChain, num_tokens: int, ttl_s: float) -> int:
        """Pin the cached whole blocks of the first `num_tokens` tokens of a chain for `ttl_s` seconds
        (or renew that pin); returns the blocks pinned. Without prefix caching there is nothing to pin."""
        if not self.enable_caching:
            return 0
        return self.pins.pin(block_hashes.hashes[: num_tokens // self.block_size], ttl_s)

    def record_cache_write(self, num_tokens: int) -> None:
        """Count tokens a request wrote to the cache at a breakpoint (reported with the pins)."""
        self.pins.cache_write_tokens += num_tokens

    def expire_pins(self) -> int:
        return self.pins.expire()

    def pin_stats(self) -> PinStats:
        return self.pins.stats()

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table) if table else 0

    def block_states(self) -> tuple[list[int], list[bool], dict[str, list[int]]]:
        """Read-only view for the lab's block map: each block's ref count and whether it holds a
        cached prefix (by block id), and each request's block ids. O(blocks + held blocks)."""
        blocks = self.pool.blocks
        return ([block.ref_cnt for block in blocks], [block.block_hash is not None for block in blocks],
                {request_id: [block.block_id for block in table] for request_id, table in self._tables.items()})

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks (tail first). Freeing an unknown id is a no-op."""
        self._num_cached.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def _check_chain(self, block_hashes: BlockHashChain) -> None:
        if block_hashes.block_size not in (None, self.block_size):
            raise ValueError(f"block hashes were computed over {block_hashes.block_size}-token blocks; "
                             f"this cache uses {self.block_size}")

    def check_integrity(self) -> None:
        """free + used == total; every held block's ref_cnt equals the number of tables holding it.
        Raises KVIntegrityError otherwise."""
        self.pool.check_integrity()
        self.pins.check_integrity()
        holders = Counter(block.block_id for table in self._tables.values() for block in table)
        for block in self.pool.blocks:
            held_by = holders.get(block.block_id, 0)
            if block.ref_cnt != held_by:
                raise KVIntegrityError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {held_by} tables")
        if self.num_free_blocks + len(holders) != self.num_blocks:
            raise KVIntegrityError(f"{self.num_free_blocks} free + {len(holders)} held blocks != "
                                   f"{self.num_blocks} in the pool")
