"""The KV cache manager: per-request block tables over the block pool, as one facade.

The scheduler asks only yes/no questions (`allocate_slots`, `can_fit`) and gets opaque prefix matches; it
never sees a block. The runner gets block ids to address the paged tensors (`block_ids`, or what changed
since it last asked: `take_block_updates`). Behind the facade, vLLM v1's coordinator shape: one manager per
KV group and attention kind (kv/groups/full.py, kv/groups/window.py), each holding its group's tables (all of one length
per request); the prefix cache (kv/prefix/prefix_cache.py), pins (kv/prefix/pins.py) and the context shift
(kv/context_shift.py) each in their own module; the pool (kv/pool/block_pool.py) tells subscribers what enters
and leaves the cache (kv/events/events.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvserve.arith import cdiv
from kvserve.errors import KVIntegrityError
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.block_updates import BlockTableUpdate, BlockTableUpdates, table_ids
from kvserve.kv.compressed_chunks import CompressedRequests
from kvserve.kv.compressed_tables import CompressedTables
from kvserve.kv.context_shift import ShiftPlan, plan_shift
from kvserve.kv.groups.full import FullAttentionManager
from kvserve.kv.groups.group_manager import GroupManager
from kvserve.kv.prefix.hashing import BlockHash, BlockHashChain
from kvserve.kv.prefix.pins import PinStats, PinTable
from kvserve.kv.prefix.prefix_cache import Divergence, PrefixCache, PrefixMatch
from kvserve.kv.tiers.connector import TierConnector, TierLoad
from kvserve.kv.groups.window import SlidingWindowManager
from kvserve.kv.manager_integrity import check_manager_integrity
from kvserve.kv.state.manager import RecurrentStates, StateStats, StateStep


class KVCacheManager(CompressedTables):
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, enable_caching: bool = False,
                 max_pinned_fraction: float = 0.5, clock: Callable[[], float] | None = None,
                 group_windows: Sequence[int | None] = (None,), tiers: TierConnector | None = None,
                 states: RecurrentStates | None = None) -> None:
        """`group_windows`: each KV group's sliding window (None: full attention); one group by default.
        `tiers`: lower tiers where a prefix match continues past the pool (one group only). `states`: a
        hybrid model's recurrent-state slots (kv/state/manager.py), a cache kind beside the groups."""
        if not group_windows:
            raise ValueError("a KV cache has at least one group")
        if tiers is not None and (len(group_windows) > 1 or states is not None):
            raise ValueError("a lower tier holds the blocks of a single KV group (no recurrent-state snapshots)")
        self.states = states
        self.tiers = tiers
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks, block_size)
        self.groups: tuple[GroupManager, ...] = tuple(
            FullAttentionManager(self.pool, block_size, group) if window is None
            else SlidingWindowManager(self.pool, block_size, group, window)
            for group, window in enumerate(self.group_windows))
        self._windowed = tuple(group for group in self.groups if not group.keeps_whole_chains)
        self.compressed = CompressedRequests()  # requests whose tables hold slots (kv/compressed_tables.py)
        self.prefix = PrefixCache(self.pool, block_size, enable_caching, self.groups, self.states, self.compressed)
        self._cut_parts = (*self.groups, *([self.states] if self.states is not None else []))  # agree on a cut
        # Admissions keep this many blocks free, so running requests can grow before anyone is preempted.
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 and num_blocks > 1 else 0
        # Cache breakpoints with a TTL (kv/prefix/pins.py): evicted last, within a share of the pool.
        self.pins = PinTable(self.pool, int(max_pinned_fraction * num_blocks), clock)
        self._updates = BlockTableUpdates()

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

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks a request of `num_tokens` holds at once, over every group: a windowed group
        holds its window plus the chunk it is computing (at most `max_chunk_tokens`)."""
        return sum(group.peak_blocks(num_tokens, max_chunk_tokens) for group in self.groups)

    def can_fit(self, num_tokens: int, max_chunk_tokens: int | None = None) -> bool:
        """Whether a request of `num_tokens` could ever fit, with the whole pool to itself."""
        return self.peak_blocks(num_tokens, max_chunk_tokens) <= self.num_blocks

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> PrefixMatch:
        """The longest prefix of `token_ids` cached in the pool, capped at len(token_ids) - 1 tokens."""
        return self.prefix.find_cached_prefix(token_ids, block_hashes)

    def match_prefix(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> PrefixMatch:
        """The one lookup of an admission: the pool's longest cached prefix and, where it ends, the lower
        tiers' continuation (`match.tier`), capped together at len(token_ids) - 1 tokens."""
        return self.prefix.match_prefix(token_ids, block_hashes, self.tiers)

    def tier_load(self, request_id: str, match: PrefixMatch) -> TierLoad:
        """What to read for a request just given slots for a `match` that continues in a lower tier."""
        return self.prefix.tier_load(request_id, match)

    def find_divergence(self, token_ids: Sequence[int], match: PrefixMatch) -> Divergence | None:
        return self.prefix.find_divergence(token_ids, match)

    def next_block_key(self, token_ids: Sequence[int], block_hashes: BlockHashChain,
                       match: PrefixMatch) -> BlockHash | None:
        return self.prefix.next_block_key(token_ids, block_hashes, match)

    def pending_block_keys(self, request_id: str, block_hashes: BlockHashChain, end: int) -> set[BlockHash]:
        return self.prefix.pending_block_keys(request_id, block_hashes, end)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], block_hashes: BlockHashChain,
                          num_computed_tokens: int) -> None:
        """After a step: the request's full computed blocks (and its state snapshots) become hittable."""
        self.prefix.cache_full_blocks(request_id, token_ids, block_hashes, num_computed_tokens)
        if self.states is not None:
            self.states.after_step(request_id, num_computed_tokens, self.prefix.state_keys(block_hashes))

    def allocate_slots(self, request_id: str, num_tokens: int, keep_watermark: bool = False,
                       prefix: PrefixMatch | None = None, tenant: str | None = None) -> bool:
        """Make the request's tables cover `num_tokens` tokens; False (and nothing changes) if blocks run out.
        `prefix` (only for a request that holds no blocks) shares the matched pool blocks instead; the
        blocks of its tier part are fresh ones, the request's own while they are loaded. New blocks count
        against `tenant`'s share, which decides whose cached blocks they may evict (kv/pool/tenant_quota.py)."""
        self._compact_due(request_id, num_tokens, prefix)  # a compressing request's full-attention tables
        held = bool(self.groups[0].tables.get(request_id))
        hit = prefix if prefix is not None and not held and prefix.num_tokens else None
        needed = self._blocks_needed(request_id, num_tokens, hit)  # per group (kv/compressed_tables.py)
        shared = hit.blocks if hit is not None else ()
        # Shared blocks nobody holds are still in the free queue: taking them uses free blocks too.
        claimed = sum(1 for block in shared if block.ref_cnt == 0)
        reserve = self.watermark_blocks if keep_watermark else 0
        free = self.pool.num_free_for(tenant, sum(needed) + claimed + reserve)
        if sum(needed) + claimed > free - reserve:
            return False
        if self.states is not None and not self.states.started(request_id) and not self.states.start(
                request_id, hit.num_tokens if hit is not None else 0, hit.state_slot if hit is not None else None,
                prefix.num_attention_tokens if prefix is not None else 0):
            return False  # every state slot is held by a running request
        if hit is not None:
            self.pins.refresh_hit(shared)  # a hit on a pinned prefix renews its TTL
            self.pool.touch(shared)
            self.prefix.claimed(request_id, hit.num_pool_tokens // self.block_size)
            for group, table in zip(self.groups, hit.tables):
                group.start(request_id, table)
            self._updates.changed(request_id)
        elif request_id not in self.groups[0].tables:
            for group in self.groups:
                group.start(request_id, ())
        if any(needed):
            fresh = iter(self.pool.allocate(sum(needed), tenant))
            for group, count in zip(self.groups, needed):
                group.extend(request_id, [next(fresh) for _ in range(count)])
        return True

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Drop the request's K/V after its first `num_tokens` tokens (rejected draft tokens, a retokenized
        tail): blocks wholly past the cut go back to the pool, tail first (a cached one keeps its hash: its
        content is still what the hash says), and a cached block the cut falls inside leaves the cache.
        Returns the tokens the tables now cover: `num_tokens`, unless the cut falls inside a block other
        requests share (then that block's start) or before blocks a window freed (then 0); the caller
        recomputes from there. A compressing request's full-attention tables count slots (kv/compressed_tables.py)."""
        for group, offset in zip(self.groups, self.slot_offsets(request_id)):
            if not 0 <= num_tokens <= (held := len(group.tables.get(request_id, ())) * self.block_size + offset):
                raise ValueError(f"cannot truncate request {request_id} to {num_tokens} tokens: its tables hold "
                                 f"{held}")
        kept = self._cut_point(request_id, num_tokens)
        if kept < self.compressed.compressed_end(request_id):
            self.compressed.reset(request_id)  # back to 0: it computes (and compresses) its chunks again
        if self.states is not None:
            self.states.cut(request_id, kept)
        self.prefix.cut(request_id, kept // self.block_size)
        for group, offset in zip(self.groups, self.slot_offsets(request_id)):
            dropped = group.cut(request_id, kept - offset)
            if dropped:
                self.pool.free(reversed(dropped))
                self._updates.changed(request_id)
        return kept

    def state_step(self, request_id: str, start: int, count: int, num_speculative: int) -> StateStep | None:
        """A hybrid model's state slots for a step (kv/state/manager.py); None for other models."""
        return None if self.states is None else self.states.plan_step(request_id, start, count, num_speculative)

    def state_stats(self) -> StateStats | None:
        return None if self.states is None else self.states.stats()

    def take_block_updates(self, request_id: str) -> BlockTableUpdate:
        """The request's tables as changed since the last call for it (kv/pool/block_updates.py)."""
        return self._updates.take(request_id, [group.tables.get(request_id, ()) for group in self.groups])

    def shift(self, request_id: str, keep: int, drop: int, num_computed_tokens: int) -> ShiftPlan | None:
        """Drop tokens keep..keep+drop-1 of the request's `num_computed_tokens` cached ones; the later ones
        move `drop` positions earlier (kv/context_shift.py). Full attention only (one group, no window).
        None, and nothing changes, if the blocks it must copy do not fit in the free ones."""
        if self.group_windows != (None,) or self.states is not None:
            raise ValueError("a context shift applies to full-attention models (one group, no window or state)")
        plan = plan_shift(self.pool, self.groups[0].tables[request_id], keep, drop, num_computed_tokens)
        if plan is not None:
            self.prefix.never_cache_from(request_id, keep // self.block_size)
            self._updates.changed(request_id)
        return plan

    def free_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Free the blocks of windowed groups that no later query of the request reads (those wholly before
        the window of position `num_computed_tokens`); their table positions become null. Returns how many."""
        if not self._windowed:  # every step, every request: nothing to do for full attention
            return 0
        freed = sum(group.free_behind_window(request_id, num_computed_tokens) for group in self._windowed)
        if freed:
            self._updates.changed(request_id)
        return freed

    def pin(self, block_hashes: BlockHashChain, num_tokens: int, ttl_s: float) -> int:
        """Pin the cached whole blocks of the first `num_tokens` tokens of a chain for `ttl_s` seconds
        (or renew that pin); returns the blocks pinned. Without prefix caching there is nothing to pin."""
        blocks = self.prefix.pinnable_blocks(block_hashes, num_tokens)
        return self.pins.pin(blocks[-1][1], blocks, ttl_s) if blocks else 0

    def record_cache_write(self, num_tokens: int) -> None:
        """Count tokens a request wrote to the cache at a breakpoint (reported with the pins)."""
        self.pins.cache_write_tokens += num_tokens

    def expire_pins(self) -> int:
        return self.pins.expire()

    def pin_stats(self) -> PinStats:
        return self.pins.stats()

    def block_ids(self, request_id: str, start: int = 0) -> list[list[int]]:
        """The request's block table of each group (NULL_BLOCK_ID where a window freed the block), from its
        `start`-th block on (a step's drafts need only the tail)."""
        return [table_ids(group.tables.get(request_id, ())[start:]) for group in self.groups]

    def blocks_held_by_group(self, request_id: str) -> list[int]:
        # list.count in C, not a generator: a step asks twice per request (its stats and its output), over
        # tables as long as its context. KVBlock keeps object identity as equality, so only None is counted.
        tables = (group.tables.get(request_id, ()) for group in self.groups)
        return [len(table) - table.count(None) for table in tables]

    def blocks_over_share(self, tenant: str | None) -> float:
        """Blocks `tenant` holds over its fair share of the pool (negative: under; 0: one tenant)."""
        return self.pool.quota.over(tenant) if self.pool.quota.shared else 0.0

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds over every group."""
        return sum(self.blocks_held_by_group(request_id))

    def block_states(self) -> tuple[list[int], list[bool], dict[str, list[int]]]:
        """The lab's block map: each block's ref count, whether it is cached, each request's block ids."""
        blocks = self.pool.blocks
        return ([block.ref_cnt for block in blocks], [block.block_hash is not None for block in blocks],
                {request_id: [block.block_id for group in self.groups for block in group.tables[request_id]
                              if block is not None] for request_id in self.groups[0].tables})

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks (tail first) and forget it. Freeing an unknown id is a no-op."""
        self.prefix.forget(request_id)
        self.compressed.reset(request_id)
        if self.states is not None:
            self.states.free(request_id)
        self._updates.changed(request_id)
        for group in self.groups:
            group.free(request_id)

    def check_integrity(self) -> None:
        """Block and state accounting hold (kv/manager_integrity.py); raises KVIntegrityError otherwise."""
        check_manager_integrity(self)
