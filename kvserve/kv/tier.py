"""A lower KV tier below the block pool: what it is asked, and what it reports.

The pool is fast and small; a tier is slower and bigger (disk here; host
memory under a GPU pool later). Full, hashed blocks are written through to it
as they are produced, so evicting a block from the pool only drops the memory
copy. Where a request's in-pool prefix match ends, the match continues into
the tier; the engine loads those blocks back into pool blocks before the
request is scheduled (kvserve/engine/tiering.py), so the scheduler only ever
sees pool blocks.

A tier stores opaque payloads (one block's K/V bytes, all layers) under a
`BlockKey`. It must never return a payload for a key it was not stored
under: keys carry the parent hash and token ids, not just the digest, so a
hash collision is a miss; and every payload is checked (checksum) when read.
"""

from __future__ import annotations

import abc
import bisect
from dataclasses import dataclass, field
from typing import Sequence

from kvserve.kv.hashing import BlockHash

Payload = bytes | memoryview  # one block's K/V bytes, every layer (a view avoids copying 100s of KiB)

# Upper bounds (seconds) of the load-time histogram: one load is one request's run of blocks.
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What identifies a full block's contents: its hash, the hash it chains from, and its tokens."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's counters (monotonic unless noted) and state, for the engine's stats snapshot."""

    kind: str  # "disk"
    location: str  # where it lives (the directory)
    enabled: bool  # False once it has disabled itself (disk full, unwritable)
    capacity_bytes: int
    bytes_used: int  # now
    num_blocks: int  # blocks held now
    pending_writes: int  # blocks queued for the background writer now
    query_tokens: int  # tokens looked up past the pool's match
    hit_tokens: int  # tokens loaded back into the pool
    blocks_written: int
    bytes_written: int
    blocks_read: int
    bytes_read: int
    blocks_evicted: int  # dropped for capacity (LRU)
    bytes_evicted: int
    writes_dropped: int  # not written: the writer was too far behind, or the tier was disabled
    files_rejected: int  # truncated, corrupted or foreign files found, skipped and removed
    load_seconds_buckets: tuple[int, ...]  # count of loads <= each LOAD_SECONDS_BUCKETS bound (cumulative)
    load_seconds_count: int
    load_seconds_sum: float


@dataclass(slots=True)
class TierCounters:
    """A tier's monotonic counters; the tier keeps them under its own lock."""

    query_tokens: int = 0
    hit_tokens: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_evicted: int = 0
    bytes_evicted: int = 0
    writes_dropped: int = 0
    files_rejected: int = 0
    load_seconds_count: int = 0
    load_seconds_sum: float = 0.0
    load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_SECONDS_BUCKETS))  # not cumulative

    def record_load(self, num_tokens: int, elapsed_s: float) -> None:
        """One load of a request's run of blocks: `num_tokens` tokens came back in `elapsed_s` seconds."""
        self.hit_tokens += num_tokens
        self.load_seconds_count += 1
        self.load_seconds_sum += elapsed_s
        slot = bisect.bisect_left(LOAD_SECONDS_BUCKETS, elapsed_s)
        if slot < len(self.load_buckets):
            self.load_buckets[slot] += 1

    def snapshot(self, kind: str, location: str, enabled: bool, capacity_bytes: int, bytes_used: int,
                 num_blocks: int, pending_writes: int) -> TierStats:
        cumulative, running = [], 0
        for count in self.load_buckets:
            running += count
            cumulative.append(running)
        return TierStats(
            kind=kind, location=location, enabled=enabled, capacity_bytes=capacity_bytes, bytes_used=bytes_used,
            num_blocks=num_blocks, pending_writes=pending_writes, query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens, blocks_written=self.blocks_written, bytes_written=self.bytes_written,
            blocks_read=self.blocks_read, bytes_read=self.bytes_read, blocks_evicted=self.blocks_evicted,
            bytes_evicted=self.bytes_evicted, writes_dropped=self.writes_dropped,
            files_rejected=self.files_rejected, load_seconds_buckets=tuple(cumulative),
            load_seconds_count=self.load_seconds_count, load_seconds_sum=self.load_seconds_sum,
        )


class KVTier(abc.ABC):
    """The interface the engine uses: lookup, load, store, evict, stats (DESIGN §3, Tiers).

    `enabled` turns False for good when the tier gives up (disk full, unwritable); from then on
    lookups miss and stores are dropped, and serving goes on without it.
    """

    enabled: bool = True

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, the tier holds (the longest run of consecutive blocks)."""

    @abc.abstractmethod
    def load(self, keys: Sequence[BlockKey]) -> list[Payload]:
        """The payloads of `keys`, in order, stopping at the first that is missing or fails its check
        (that one is dropped from the tier). Never raises for a bad entry: a shorter list is a miss."""

    @abc.abstractmethod
    def store(self, entries: Sequence[tuple[BlockKey, Payload]]) -> None:
        """Keep these blocks (written in the background: returns at once; may drop them if behind)."""

    @abc.abstractmethod
    def evict(self, key: BlockKey) -> bool:
        """Drop one block; whether it was held."""

    @abc.abstractmethod
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a block with this hash is held or queued to be written (a cheap pre-check for stores)."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A consistent copy of the counters, safe from any thread."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Block until every queued store is written (or dropped)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the tier's resources (threads, files)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise KVIntegrityError if the tier's own accounting is inconsistent."""
