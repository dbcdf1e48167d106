"""Prefix caching over the block pool: lookups, misses explained, and full blocks registered.

Prefix hashing (DESIGN §3, kv/prefix/hashing.py): a full block's hash chains its
parent block's hash and its token ids. The chain's root is derived from the
request's cache salt, so requests with different salts never share a block,
and a miss is only ever explained against the same salt's blocks. Each
request computes its chain once, as its tokens arrive (`BlockHashChain`);
this module only indexes it.

A hit must be served by every KV group: the coordinator's loop asks each
group's manager (kv/groups/full.py, kv/groups/window.py) how much of it it can serve until
they agree. Full-attention groups need every block of the hit; windowed ones
only those inside the window of the first token computed after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvserve.kv.compressed_chunks import CompressedRequests
from kvserve.kv.prefix.compressed_keys import slot_keys
from kvserve.kv.prefix.compressed_prefix import CompressedPrefix
from kvserve.kv.prefix.compressed_tier import loaded_tokens, tier_hit
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import KVBlock
from kvserve.kv.groups.group_manager import GroupManager
from kvserve.kv.prefix.hashing import BlockHash, BlockHashChain
from kvserve.kv.prefix.pins import CacheKey
from kvserve.kv.state.manager import RecurrentStates
from kvserve.kv.tiers.connector import BlockKey, TierConnector, TierHit, TierLoad

# (group, table index) -> the cached block for that index of a chain in that group, if any
GroupLookup = Callable[[int, int], KVBlock | None]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached blocks a request's tokens start with, then (`tier`) the blocks a lower tier holds after
    them: where each part came from is said here, not on the blocks. Opaque to the scheduler."""

    tables: tuple[tuple[KVBlock | None, ...], ...]  # per KV group, the pool's part; None: behind the window
    num_tokens: int  # the pool's part and the tier's
    last_hash: BlockHash  # hash of the last matched block (the chain root if none matched)
    num_tier_tokens: int = 0  # of num_tokens, those a lower tier holds (to be loaded into fresh blocks)
    tier: TierHit | None = None  # the tier and the keys of those blocks
    # Hybrid models: the recurrent-state snapshot after the hit's tokens (None: no hit, a fresh state), and
    # how far the attention blocks alone would have gone (when further than any snapshot: a fork).
    state_slot: int | None = None
    num_attention_tokens: int = 0

    @property
    def blocks(self) -> tuple[KVBlock, ...]:
        """Every matched pool block of every group (the nulls left out)."""
        return tuple(block for table in self.tables for block in table if block is not None)

    @property
    def num_pool_tokens(self) -> int:
        return self.num_tokens - self.num_tier_tokens

    def continued(self, hit: TierHit, block_size: int) -> PrefixMatch:
        """This match followed by the blocks `hit` holds."""
        num_tier_tokens = len(hit.keys) * block_size
        return PrefixMatch(self.tables, self.num_tokens + num_tier_tokens, hit.keys[-1].block_hash,
                           num_tier_tokens, hit)


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a request's tokens left the closest cached chain."""

    position: int  # index of the first token that differs from the closest cached block
    cached_token_ids: tuple[int, ...]  # that cached block's tokens (it starts at block_start)
    block_start: int


class PrefixCache:
    """The prefix cache's questions and each request's cached blocks, for one pool and its group managers."""

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool,
                 groups: Sequence[GroupManager], states: RecurrentStates | None = None,
                 compressed: CompressedRequests | None = None) -> None:
        self.pool = pool
        self.states = states  # a hybrid model's: a hit must also end where a state snapshot resumes it
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = tuple(groups)
        # Per request: how many leading blocks of its tables are registered in the cache (shared or cached).
        self._num_cached: dict[str, int] = {}
        # Per request: blocks from this one on hold shifted K/V (a context shift): never cached under a hash.
        self._cache_limit: dict[str, int] = {}
        # Compressing requests (kv/compressed_tables.py): their blocks are keyed per slot or position
        # (compressed_keys.py), found and registered by compressed_prefix.py.
        self.compressed = compressed if compressed is not None else CompressedRequests()
        self._compressed = CompressedPrefix(pool, block_size, self.groups, states, self.compressed)

    def longest_hit(self, lookup: GroupLookup, limit: int) -> tuple[tuple[KVBlock | None, ...], ...]:
        """Per group, the blocks of the longest hit of at most `limit` blocks every group can serve."""
        found: list[dict[int, KVBlock | None]] = [{} for _ in self.groups]

        def getter(group: int) -> Callable[[int], KVBlock | None]:
            def get(index: int) -> KVBlock | None:
                if index not in found[group]:
                    found[group][index] = lookup(group, index)
                return found[group][index]
            return get

        getters = [getter(group) for group in range(len(self.groups))]
        num, settled = limit, False
        while not settled and num > 0:
            settled = True
            for manager, get in zip(self.groups, getters):
                served = manager.longest_hit(get, num)
                if served < num:
                    num, settled = served, False
        tables = []
        for manager, get in zip(self.groups, getters):
            first = manager.first_needed_block(num * self.block_size)
            tables.append((None,) * first + tuple(get(index) for index in range(first, num)))
        return tuple(tables)

    def max_hit_blocks(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> int:
        """At most len(token_ids) - 1 tokens: at least one is always computed, for logits to sample from."""
        return min(len(block_hashes), (len(token_ids) - 1) // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> PrefixMatch:
        """The longest chain of cached blocks `token_ids` (hashed as `block_hashes`) starts with."""
        if not self.enable_caching:
            return PrefixMatch(((),) * len(self.groups), 0, block_hashes.root)
        if block_hashes.block_size not in (None, self.block_size):
            raise ValueError(f"block hashes were computed over {block_hashes.block_size}-token blocks; "
                             f"this cache uses {self.block_size}")
        if block_hashes.compression is not None:
            return self._compressed.find(token_ids, block_hashes)
        bs, hashes = self.block_size, block_hashes.hashes

        def lookup(group: int, index: int) -> KVBlock | None:
            return self.pool.lookup(hashes[index], block_hashes.parent(index),
                                    token_ids[index * bs : (index + 1) * bs], group)

        tables = self.longest_hit(lookup, self.max_hit_blocks(token_ids, block_hashes))
        num_attention = num_blocks = len(tables[0])
        state_slot = None
        if self.states is not None:
            # The attention groups and the state agree, as the groups do among themselves: the state serves
            # up to its last snapshot, and the groups are asked again up to there.
            while (served := self.states.longest_hit(hashes, num_blocks)) < num_blocks:
                tables = self.longest_hit(lookup, served)
                num_blocks = len(tables[0])
            state_slot = self.states.snapshot_for(hashes, num_blocks)
        last = hashes[num_blocks - 1] if num_blocks else block_hashes.root
        return PrefixMatch(tables, num_blocks * bs, last, state_slot=state_slot,
                           num_attention_tokens=num_attention * bs)

    def match_prefix(self, token_ids: Sequence[int], block_hashes: BlockHashChain,
                     tiers: TierConnector | None) -> PrefixMatch:
        """The pool's longest cached prefix, continued where it ends by the first of `tiers` that holds the
        next blocks (one group only: a tier holds the blocks of a single KV group)."""
        match = self.find_cached_prefix(token_ids, block_hashes)
        if tiers is None:
            return match
        if block_hashes.compression is not None:
            return self._continue_compressed(token_ids, block_hashes, match, tiers)
        hit = tiers.lookup(self.keys_after(token_ids, block_hashes, match))
        return match if hit is None else match.continued(hit, self.block_size)

    def tier_load(self, request_id: str, match: PrefixMatch) -> TierLoad:
        """What to read for a request just given blocks for `match` (whose `tier` is set): its fresh blocks
        after the pool's part, one per key."""
        if match.tier is None:
            raise ValueError(f"request {request_id}: its prefix match does not continue in a lower tier")
        start = len(match.tables[0])
        table = self.groups[0].tables[request_id][start : start + len(match.tier.keys)]
        return TierLoad(request_id, match.tier, tuple(block.block_id for block in table))

    def keys_after(self, token_ids: Sequence[int], block_hashes: BlockHashChain,
                   match: PrefixMatch) -> list[BlockKey]:
        """The keys of the blocks a hit could still cover after `match`: where a lower tier may continue it."""
        if not self.enable_caching:
            return []
        bs, hashes = self.block_size, block_hashes.hashes
        return [BlockKey(hashes[i], block_hashes.parent(i), tuple(token_ids[i * bs : (i + 1) * bs]))
                for i in range(match.num_tokens // bs, self.max_hit_blocks(token_ids, block_hashes))]

    def _continue_compressed(self, token_ids: Sequence[int], block_hashes: BlockHashChain, match: PrefixMatch,
                             tiers: TierConnector) -> PrefixMatch:
        """A compressing request's `match` continued below the pool by its slot blocks (compressed_tier.py)."""
        keys = slot_keys(block_hashes.compression, block_hashes, token_ids)[len(match.tables[0]):]
        found = tier_hit(keys, tiers, len(token_ids) - 1) if self.enable_caching else None
        if found is None:
            return match
        hit, last = found
        return PrefixMatch(match.tables, last.end, last.block_hash, last.end - match.num_tokens, hit)

    def tier_loaded_tokens(self, token_ids: Sequence[int], block_hashes: BlockHashChain, match: PrefixMatch,
                           num_blocks: int) -> int:
        """Tokens a request's blocks hold once the first `num_blocks` blocks of `match`'s tier part arrived (a
        compressing request's: up to the last whole chunk, or later block, among them)."""
        if block_hashes.compression is None:
            return match.num_pool_tokens + num_blocks * self.block_size
        start = len(match.tables[0])
        keys = slot_keys(block_hashes.compression, block_hashes, token_ids)[start : start + num_blocks]
        return loaded_tokens(keys, match.num_pool_tokens)

    def find_divergence(self, token_ids: Sequence[int], match: PrefixMatch) -> Divergence | None:
        """Compare the block after the match with every cached block that continues the same
        chain; the one sharing the most leading tokens says where `token_ids` diverged."""
        start = match.num_tokens
        ours = tuple(token_ids[start : start + self.block_size])
        best, best_common = None, -1
        # Explained against a group that keeps whole chains (a windowed one may have lost the blocks before).
        group = next((manager.group for manager in self.groups if manager.keeps_whole_chains), 0)
        for block in self.pool.children_of(match.last_hash, group).values():
            common = 0
            while common < len(ours) and block.token_ids[common] == ours[common]:
                common += 1
            if common > best_common:
                best, best_common = block, common
        if best is None or best_common == len(ours):
            return None  # nothing cached continues this prefix, or the tokens ran out, not diverged
        return Divergence(start + best_common, best.token_ids, start)

    def next_block_key(self, token_ids: Sequence[int], block_hashes: BlockHashChain,
                       match: PrefixMatch) -> BlockHash | None:
        """Hash of the first block after the pool's part of `match` (a tier's blocks are not in the pool
        yet), if the tokens fill it and it is not the last token's block."""
        start, bs = match.num_pool_tokens, self.block_size
        index = start // bs
        if not self.enable_caching or start + bs > len(token_ids) - 1 or index >= len(block_hashes):
            return None
        return block_hashes.hashes[index]

    def pending_block_keys(self, request_id: str, block_hashes: BlockHashChain, end: int) -> set[BlockHash]:
        """Hashes of the request's full blocks up to token `end` not yet computed: what it is about
        to compute and cache. Another request whose next block is among them need not compute it too."""
        if not self.enable_caching or request_id in self.compressed:
            return set()  # a compressing request's keys are not its token chain's
        return set(block_hashes.hashes[self._num_cached.get(request_id, 0) : end // self.block_size])

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], block_hashes: BlockHashChain,
                          num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full and computed, so later requests can share them."""
        if not self.enable_caching:
            return
        if request_id in self.compressed:
            self._compressed.cache(request_id, token_ids, block_hashes, num_computed_tokens)
            return
        length = len(self.groups[0].tables.get(request_id, ()))
        done = self._num_cached.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, length, len(block_hashes),
                  self._cache_limit.get(request_id, length))
        if end <= done:  # the common case, every step of every decoding request
            return
        tables = [manager.tables[request_id] for manager in self.groups]
        bs, hashes = self.block_size, block_hashes.hashes
        for index in range(done, end):
            chunk = tuple(token_ids[index * bs : (index + 1) * bs])
            parent = block_hashes.parent(index)
            for group, table in enumerate(tables):
                block = table[index]
                if block is not None:  # None: freed behind a window before it was full, nothing to share
                    self.pool.cache_block(block, hashes[index], parent, chunk, group, first=index == 0)
        self._num_cached[request_id] = end

    def state_keys(self, block_hashes: BlockHashChain) -> Sequence[BlockHash]:
        """The keys a hybrid's state snapshots after each of the chain's blocks go under (its hashes, but for a
        compressing request's: kv/prefix/compressed_keys.py)."""
        if block_hashes.compression is not None:
            return self._compressed.state_keys(block_hashes)
        return block_hashes.hashes

    def pinnable_blocks(self, block_hashes: BlockHashChain, num_tokens: int) -> list[CacheKey]:
        """The cached blocks, in every group, that a hit up to token `num_tokens` of the chain needs (or
        the longest still cached part of it), root first: what a pin there covers."""
        if not self.enable_caching:
            return []
        hashes = block_hashes.hashes[: num_tokens // self.block_size]
        tables = self.longest_hit(lambda group, index: self.pool.cached_block(hashes[index], group), len(hashes))
        return [(group, hashes[index]) for index in range(len(tables[0]))
                for group, table in enumerate(tables) if table[index] is not None]

    def num_cached(self, request_id: str) -> int:
        return self._num_cached.get(request_id, 0)

    def claimed(self, request_id: str, num_blocks: int) -> None:
        """The request starts with `num_blocks` token blocks of a hit, already registered."""
        if request_id in self.compressed:
            self._compressed.claimed(request_id, num_blocks)
        else:
            self._num_cached[request_id] = num_blocks

    def cut(self, request_id: str, num_blocks: int) -> None:
        """The request's blocks from token block `num_blocks` on hold other K/V than their hash says, or are gone."""
        if request_id in self.compressed:
            self._compressed.cut(request_id, num_blocks)
        elif self._num_cached.get(request_id, 0) > num_blocks:
            self._num_cached[request_id] = num_blocks

    def never_cache_from(self, request_id: str, index: int) -> None:
        """Blocks from `index` on hold shifted K/V for good: no hash describes them."""
        self.cut(request_id, index)
        self._cache_limit[request_id] = index

    def forget(self, request_id: str) -> None:
        self._compressed.forget(request_id)
        self._num_cached.pop(request_id, None)
        self._cache_limit.pop(request_id, None)
