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

KV groups (kv/groups.py): a request has one table per group, all of the same
length. In a windowed group, blocks wholly behind the window of the next query
are freed as the request advances (`free_behind_window`) and their positions
hold None (the null block, id -1, which attention never reads). A prefix hit
needs every block of full-attention groups, but in a windowed group only the
blocks inside the window of the first token computed after the hit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from kvserve.arith import cdiv
from kvserve.errors import KVIntegrityError
from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.groups import first_needed_block
from kvserve.kv.hashing import BlockHash, BlockHashChain
from kvserve.kv.pins import PinStats, PinTable
from kvserve.kv.tier import BlockKey


# A table position whose block was freed behind a sliding window: the null block.
NULL_BLOCK_ID = -1

BlockTable = list[KVBlock | None]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached blocks a request's tokens start with. Opaque to the scheduler."""

    tables: tuple[tuple[KVBlock | None, ...], ...]  # per KV group; None: behind the window, not needed
    num_tokens: int
    last_hash: BlockHash  # hash of the last matched block (the chain root if none matched)
    num_tier_tokens: int = 0  # of num_tokens, those in blocks just loaded from a lower tier

    @property
    def blocks(self) -> tuple[KVBlock, ...]:
        """Every matched block of every group (the nulls left out)."""
        return tuple(block for table in self.tables for block in table if block is not None)


@dataclass(frozen=True, slots=True)
class TokenMoves:
    """Rows of the pool to copy, token by token: (block id, row) pairs, sources read before any is written.
    Opaque ints for the runner, which moves the K/V (and re-rotates moved keys)."""

    src_blocks: tuple[int, ...]
    src_rows: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    dst_rows: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShiftPlan:
    """A context shift's K/V work: `copied` rows keep their position (a kept block that had to be copied),
    `moved` rows go `drop` positions earlier (their keys re-rotated by -drop)."""

    drop: int
    copied: TokenMoves
    moved: TokenMoves


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a request's tokens left the closest cached chain."""

    position: int  # index of the first token that differs from the closest cached block
    cached_token_ids: tuple[int, ...]  # that cached block's tokens (it starts at block_start)
    block_start: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, enable_caching: bool = False,
                 record_cached_blocks: bool = False, max_pinned_fraction: float = 0.5,
                 clock: Callable[[], float] | None = None, group_windows: Sequence[int | None] = (None,)) -> None:
        """`group_windows`: each KV group's sliding window (None: full attention); one group by default."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self._has_windows = any(window is not None for window in self.group_windows)
        if not self.group_windows:
            raise ValueError("a KV cache has at least one group")
        if record_cached_blocks and len(self.group_windows) > 1:
            raise ValueError("a lower tier holds the blocks of a single KV group")
        # With a lower tier, blocks registered in the cache are also handed to the engine to write through.
        self._record_cached = record_cached_blocks
        self._newly_cached: list[tuple[int, BlockKey]] = []
        self.pool = BlockPool(num_blocks, block_size)
        # Per request: how many leading blocks of its table are registered in the cache (shared or cached).
        self._num_cached: dict[str, int] = {}
        # Admissions keep this many blocks free, so running requests can grow
        # a little before anyone has to be preempted.
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 and num_blocks > 1 else 0
        self._tables: dict[str, list[BlockTable]] = {}  # request -> one table per group
        # request -> per group, the table positions before this one are freed (windowed groups only)
        self._freed_upto: dict[str, list[int]] = {}
        # request -> blocks from this one on hold shifted K/V (a context shift): never cached under a hash
        self._cache_limit: dict[str, int] = {}
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

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks a request of `num_tokens` holds at once, over every group: a windowed group
        holds its window plus the chunk it is computing (at most `max_chunk_tokens`)."""
        total = self.blocks_for(num_tokens)
        peak = 0
        for window in self.group_windows:
            if window is None or max_chunk_tokens is None:
                peak += total
            else:
                peak += min(total, cdiv(window - 1 + max_chunk_tokens, self.block_size) + 1)
        return peak

    def can_fit(self, num_tokens: int, max_chunk_tokens: int | None = None) -> bool:
        """Whether a request of `num_tokens` could ever fit, with the whole pool to itself."""
        return self.peak_blocks(num_tokens, max_chunk_tokens) <= self.num_blocks

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> PrefixMatch:
        """The longest chain of cached blocks `token_ids` (hashed as `block_hashes`) starts with.

        Capped at len(token_ids) - 1 tokens: at least one token is always
        computed, so there are logits to sample from.
        """
        if not self.enable_caching:
            return PrefixMatch(((),) * self.num_groups, 0, block_hashes.root)
        self._check_chain(block_hashes)
        bs, hashes = self.block_size, block_hashes.hashes

        def lookup(group: int, index: int) -> KVBlock | None:
            return self.pool.lookup(hashes[index], block_hashes.parent(index),
                                    token_ids[index * bs : (index + 1) * bs], group)

        tables = self._longest_hit(lookup, self._max_hit_blocks(token_ids, block_hashes))
        num_blocks = len(tables[0])
        from_tier = sum(block.from_tier for block in tables[0] if block is not None)
        last = hashes[num_blocks - 1] if num_blocks else block_hashes.root
        return PrefixMatch(tables, num_blocks * bs, last, from_tier * bs)

    def _longest_hit(self, lookup: Callable[[int, int], KVBlock | None],
                     limit: int) -> tuple[tuple[KVBlock | None, ...], ...]:
        """Per group, the blocks of the longest hit of at most `limit` blocks: every full-attention group
        has all of them; every windowed group has those inside the window of the first token computed after
        the hit (vLLM's hybrid search: a miss at block j in a window rules out every hit longer than j)."""
        found: list[dict[int, KVBlock | None]] = [{} for _ in self.group_windows]

        def get(group: int, index: int) -> KVBlock | None:
            if index not in found[group]:
                found[group][index] = lookup(group, index)
            return found[group][index]

        num = limit
        for group, window in enumerate(self.group_windows):
            if window is None:
                run = 0
                while run < num and get(group, run) is not None:
                    run += 1
                num = run
        settled = False
        while not settled and num > 0:
            settled = True
            for group, window in enumerate(self.group_windows):
                if window is None:
                    continue
                first = first_needed_block(window, num * self.block_size, self.block_size)
                missing = next((i for i in range(num - 1, first - 1, -1) if get(group, i) is None), None)
                if missing is not None:
                    num, settled = missing, False
                    break
        tables = []
        for group, window in enumerate(self.group_windows):
            first = first_needed_block(window, num * self.block_size, self.block_size)
            tables.append((None,) * first + tuple(found[group][i] for i in range(first, num)))
        return tuple(tables)

    def _max_hit_blocks(self, token_ids: Sequence[int], block_hashes: BlockHashChain) -> int:
        return min(len(block_hashes), (len(token_ids) - 1) // self.block_size)

    def keys_after(self, token_ids: Sequence[int], block_hashes: BlockHashChain, match: PrefixMatch) -> list[BlockKey]:
        """The keys of the blocks a hit could still cover after `match`: where a lower tier may continue it."""
        if not self.enable_caching:
            return []
        bs, hashes = self.block_size, block_hashes.hashes
        start = match.num_tokens // bs
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
        if self.num_groups > 1:
            raise ValueError("a lower tier holds the blocks of a single KV group")
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
        # A full-attention group keeps whole chains (a windowed one may have lost the blocks before).
        group = next((g for g, window in enumerate(self.group_windows) if window is None), 0)
        for block in self.pool.children_of(match.last_hash, group).values():
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
        tables = self._tables.get(request_id)
        hit = prefix if prefix is not None and not (tables and tables[0]) and prefix.num_tokens else None
        length = len(tables[0]) if tables else (len(hit.tables[0]) if hit is not None else 0)
        needed = max(self.blocks_for(num_tokens) - length, 0)  # per group
        shared = hit.blocks if hit is not None else ()
        # Shared blocks nobody holds are still in the free queue: taking them uses free blocks too.
        claimed = sum(1 for block in shared if block.ref_cnt == 0)
        reserve = self.watermark_blocks if keep_watermark else 0
        if needed * self.num_groups + claimed > self.num_free_blocks - reserve:
            return False
        if hit is not None:
            self.pins.refresh_hit(shared)  # a hit on a pinned prefix renews its TTL
            self.pool.touch(shared)
            for block in shared:
                block.from_tier = False  # counted as the tier's once, for this request
            self._num_cached[request_id] = length
            tables = [list(table) for table in hit.tables]
            self._freed_upto[request_id] = [table.count(None) for table in tables]
        elif not tables:
            tables = [[] for _ in self.group_windows]
            self._freed_upto[request_id] = [0] * self.num_groups
        self._tables[request_id] = tables
        if needed:
            fresh = self.pool.allocate(needed * self.num_groups)
            for group, table in enumerate(tables):
                table.extend(fresh[group * needed : (group + 1) * needed])
        return True

    def shift(self, request_id: str, keep: int, drop: int, num_computed_tokens: int) -> ShiftPlan | None:
        """Drop tokens keep..keep+drop-1 of a running request's `num_computed_tokens` cached ones from its
        table: the tokens after them move `drop` positions earlier (llama.cpp's context shift). Full
        attention only (one group, no window). Returns the rows to move, or None (nothing changes) if the
        blocks it must copy do not fit in the free ones.

        Blocks wholly before `keep` stay as they are, still cached. Later blocks are rewritten: in place
        when the request holds them alone (they leave the prefix cache: their K/V no longer match a fresh
        computation of their tokens), else into fresh blocks (others keep reading the old ones). Blocks past
        the new length are freed; they are read by the moves first, which the runner does before the step's
        forward writes anything. Nothing from `keep // block_size` on is cached for this request again.
        """
        if self.group_windows != (None,):
            raise ValueError("a context shift applies to full-attention models (one KV group, no window)")
        table = self._tables[request_id][0]
        bs, new_length = self.block_size, num_computed_tokens - drop
        if not 0 <= keep < new_length or drop <= 0 or len(table) * bs < num_computed_tokens:
            raise ValueError(f"cannot drop {drop} tokens after {keep} of {num_computed_tokens}")
        first, new_count = keep // bs, cdiv(new_length, bs)
        rewritten = range(first, new_count)
        shared = [index for index in rewritten if table[index].ref_cnt > 1]
        if len(shared) > self.num_free_blocks:
            return None
        fresh = iter(self.pool.allocate(len(shared)))
        new_table = table[:first] + [next(fresh) if table[index].ref_cnt > 1 else table[index] for index in rewritten]
        for index in rewritten:
            if new_table[index] is table[index]:
                self.pool.uncache(table[index])
        copied: list[tuple[int, int, int, int]] = []
        moved: list[tuple[int, int, int, int]] = []
        for position in range(first * bs, new_length):
            source = position if position < keep else position + drop
            src, dst = table[source // bs], new_table[position // bs]
            if src is dst and source == position:
                continue  # a kept row of a block rewritten in place
            row = (src.block_id, source % bs, dst.block_id, position % bs)
            (copied if position < keep else moved).append(row)
        released = [table[index] for index in shared] + table[new_count:]
        table[:] = new_table
        self.pool.free(reversed(released))
        self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), first)
        self._cache_limit[request_id] = first
        return ShiftPlan(drop, _token_moves(copied), _token_moves(moved))

    def free_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Free the blocks of windowed groups that no later query of the request reads (those wholly before
        the window of position `num_computed_tokens`); their table positions become null. Returns how many."""
        tables = self._tables.get(request_id)
        if not tables or not self._has_windows:  # every step, every request: nothing to do for full attention
            return 0
        freed_upto = self._freed_upto[request_id]
        freed = 0
        for group, window in enumerate(self.group_windows):
            if window is None:
                continue
            table = tables[group]
            end = min(first_needed_block(window, num_computed_tokens, self.block_size), len(table))
            start = freed_upto[group]
            if end <= start:
                continue
            behind = [block for block in table[start:end] if block is not None]
            table[start:end] = [None] * (end - start)
            self.pool.free(reversed(behind))  # tail first, as a finished request frees
            freed_upto[group] = end
            freed += len(behind)
        return freed

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], block_hashes: BlockHashChain,
                          num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full and computed, so later requests can share them."""
        if not self.enable_caching:
            return
        tables = self._tables.get(request_id)
        if not tables or not tables[0]:
            return
        done = self._num_cached.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(tables[0]), len(block_hashes),
                  self._cache_limit.get(request_id, len(tables[0])))
        if end <= done:
            return
        bs, hashes = self.block_size, block_hashes.hashes
        for index in range(done, end):
            chunk = tuple(token_ids[index * bs : (index + 1) * bs])
            parent = block_hashes.parent(index)
            for group, table in enumerate(tables):
                block = table[index]
                if block is None:  # freed behind a window before it was full: nothing to share
                    continue
                if self.pool.cache_block(block, hashes[index], parent, chunk, group) and self._record_cached:
                    self._newly_cached.append((block.block_id, BlockKey(hashes[index], parent, chunk)))
        self._num_cached[request_id] = end

    def pin(self, block_hashes: BlockHashChain, num_tokens: int, ttl_s: float) -> int:
        """Pin the cached whole blocks of the first `num_tokens` tokens of a chain for `ttl_s` seconds
        (or renew that pin); returns the blocks pinned. Without prefix caching there is nothing to pin."""
        if not self.enable_caching:
            return 0
        hashes = block_hashes.hashes[: num_tokens // self.block_size]
        # The blocks a hit up to the breakpoint (or the longest still cached part of it) needs, in every group.
        tables = self._longest_hit(lambda group, index: self.pool.cached_block(hashes[index], group), len(hashes))
        if not tables[0]:
            return 0
        blocks = [(group, hashes[index]) for index in range(len(tables[0]))
                  for group, table in enumerate(tables) if table[index] is not None]
        return self.pins.pin(hashes[len(tables[0]) - 1], blocks, ttl_s)

    def record_cache_write(self, num_tokens: int) -> None:
        """Count tokens a request wrote to the cache at a breakpoint (reported with the pins)."""
        self.pins.cache_write_tokens += num_tokens

    def expire_pins(self) -> int:
        return self.pins.expire()

    def pin_stats(self) -> PinStats:
        return self.pins.stats()

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group (NULL_BLOCK_ID where a window freed the block)."""
        tables = self._tables.get(request_id)
        if not tables:
            return [[] for _ in self.group_windows]
        return [[NULL_BLOCK_ID if block is None else block.block_id for block in table] for table in tables]

    def blocks_held_by_group(self, request_id: str) -> list[int]:
        tables = self._tables.get(request_id)
        if not tables:
            return [0] * self.num_groups
        return [sum(block is not None for block in table) for table in tables]

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds over every group."""
        return sum(self.blocks_held_by_group(request_id))

    def block_states(self) -> tuple[list[int], list[bool], dict[str, list[int]]]:
        """Read-only view for the lab's block map: each block's ref count and whether it holds a
        cached prefix (by block id), and each request's block ids. O(blocks + held blocks)."""
        blocks = self.pool.blocks
        return ([block.ref_cnt for block in blocks], [block.block_hash is not None for block in blocks],
                {request_id: [block.block_id for table in tables for block in table if block is not None]
                 for request_id, tables in self._tables.items()})

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks (tail first). Freeing an unknown id is a no-op."""
        self._num_cached.pop(request_id, None)
        self._freed_upto.pop(request_id, None)
        self._cache_limit.pop(request_id, None)
        tables = self._tables.pop(request_id, None)
        for table in tables or ():
            self.pool.free(block for block in reversed(table) if block is not None)

    def _check_chain(self, block_hashes: BlockHashChain) -> None:
        if block_hashes.block_size not in (None, self.block_size):
            raise ValueError(f"block hashes were computed over {block_hashes.block_size}-token blocks; "
                             f"this cache uses {self.block_size}")

    def check_integrity(self) -> None:
        """free + used == total; every held block's ref_cnt equals the number of tables holding it.
        Raises KVIntegrityError otherwise."""
        self.pool.check_integrity()
        self.pins.check_integrity()
        holders = Counter(block.block_id for tables in self._tables.values() for table in tables
                          for block in table if block is not None)
        for block in self.pool.blocks:
            held_by = holders.get(block.block_id, 0)
            if block.ref_cnt != held_by:
                raise KVIntegrityError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {held_by} tables")
        if self.num_free_blocks + len(holders) != self.num_blocks:
            raise KVIntegrityError(f"{self.num_free_blocks} free + {len(holders)} held blocks != "
                                   f"{self.num_blocks} in the pool")

    def check_tables(self, request_id: str, num_computed_tokens: int) -> None:
        """A running request's tables are one length, cover its computed tokens and hold every block a
        later query may read (windowed groups: from the window of position `num_computed_tokens` on).
        Raises KVIntegrityError otherwise."""
        tables = self._tables.get(request_id) or [[] for _ in self.group_windows]
        if len(tables) != self.num_groups or len({len(table) for table in tables}) > 1:
            raise KVIntegrityError(f"request {request_id}: its group tables differ in length")
        if len(tables[0]) * self.block_size < num_computed_tokens:
            raise KVIntegrityError(f"request {request_id} holds {len(tables[0])} blocks for "
                                   f"{num_computed_tokens} computed tokens")
        for group, (window, table) in enumerate(zip(self.group_windows, tables)):
            first = first_needed_block(window, num_computed_tokens, self.block_size)
            if any(block is None for block in table[first:]):
                raise KVIntegrityError(f"request {request_id}: group {group} lost a block its next query reads")


def _token_moves(rows: list[tuple[int, int, int, int]]) -> TokenMoves:
    src_blocks, src_rows, dst_blocks, dst_rows = zip(*rows) if rows else ((), (), (), ())
    return TokenMoves(tuple(src_blocks), tuple(src_rows), tuple(dst_blocks), tuple(dst_rows))
