"""The seam between the block pool and the tiers below it (vLLM's KV connector shape: lookup, load, store).

The pool is fast and small; a tier is slower and bigger (disk here; host
memory under a GPU pool would be one more `KVTier` in the list). Full, hashed
blocks are written through to the tiers as they are produced, so evicting a
block from the pool only drops the memory copy.

One lookup at admission (KVCacheManager.match_prefix) returns the pool's hit
and, where it ends, the tiers' continuation (a `TierHit`, carried by the
match: provenance lives there, never on a block). The request is given blocks
for both; the runner fills the continuation's blocks from a reader thread
(reader.py) while the request waits unscheduled, holding them; a block that
fails to arrive intact is recomputed, never served.

A tier stores opaque payloads (one block's K/V bytes, all layers) under a
`BlockKey`. It must never return a payload for a key it was not stored
under: keys carry the parent hash and token ids, not just the digest, so a
hash collision is a miss; and every payload is checked (checksum) when read.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

from kvserve.kv.prefix.hashing import BlockHash
from kvserve.kv.tiers.stats import TierStats

Payload = bytes | memoryview  # one block's K/V bytes, every layer (a view avoids copying 100s of KiB)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What identifies a full block's contents: its hash, the hash it chains from, its tokens and what else its
    hash chains (`extra_keys`, kv/prefix/hashing.hash_block). A token block has none: its rows are its tokens'
    K/V at their positions. A compressed chunk's kept block (KV compression, kv/prefix/compressed_keys.py) names
    its chunk and its index there: its rows are the tokens the chunk kept, its token ids the chunk's token block
    of the same index (a check against collisions, not its rows' tokens)."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: bytes = b""

    @property
    def is_kept_block(self) -> bool:
        """Whether it holds a compressed chunk's kept rows rather than its tokens' own."""
        return bool(self.extra_keys)


@dataclass(frozen=True, slots=True)
class TierHit:
    """Where a prefix match continues below the pool: the tier that holds the next blocks (its index in
    the connector's list) and their keys, in chain order."""

    tier: int
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class TierLoad:
    """One request's blocks to fill from a tier: `hit.keys[i]` goes into `block_ids[i]`. The request holds
    those blocks from its admission until it finishes: no other request, and no eviction, can take them
    while the read is in flight."""

    request_id: str
    hit: TierHit
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load delivered: its first `num_blocks` blocks are filled and intact; the rest are recomputed."""

    load: TierLoad
    num_blocks: int
    error: BaseException | None = None  # an unexpected failure (a bad entry is not one: it ends the run)


class KVTier(abc.ABC):
    """One tier: lookup, load, store, evict, stats (DESIGN §3, Tiers).

    `lookup`, `store` and `evict` run on the engine's thread; `load` on a reader thread
    (reader.py), so a tier guards its own state. `enabled` turns False for good when the tier gives up
    (disk full, unwritable, `disable`); from then on lookups miss and stores are dropped, and serving
    goes on without it.
    """

    name: str  # which tier: "disk" (a host-memory tier would be "host")
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
    def disable(self, why: str) -> None:
        """Give up for good (logged once with `why`): lookups miss, stores are dropped."""

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


class TierConnector:
    """The tiers below one pool, in the order a lookup asks them (the disk tier first; a faster tier
    would go before it), as one: the KV manager looks up, the runner's reader loads, the write-through
    stores. A lower tier holds the blocks of a single KV group."""

    def __init__(self, tiers: Sequence[KVTier]) -> None:
        names = [tier.name for tier in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"tiers need distinct names, got {names}")
        self.tiers = tuple(tiers)

    def named(self, name: str) -> KVTier | None:
        return next((tier for tier in self.tiers if tier.name == name), None)

    def lookup(self, keys: Sequence[BlockKey]) -> TierHit | None:
        """Where a match continues: the first tier in the list that holds `keys[0]`, with the run it holds
        (vLLM's multi-connector rule: a faster tier that hits spares asking the slower ones)."""
        if not keys:
            return None
        for index, tier in enumerate(self.tiers):
            if tier.enabled and (held := tier.lookup(keys)) > 0:
                return TierHit(index, tuple(keys[:held]))
        return None

    def load(self, hit: TierHit) -> list[Payload]:
        """The hit's payloads (a reader thread calls this: it may wait on a disk)."""
        return self.tiers[hit.tier].load(hit.keys)

    def wants(self, key: BlockKey, source: int | None = None) -> bool:
        """Whether some tier other than `source` (where the block came from) would keep this block."""
        return any(tier.enabled and index != source and not tier.contains(key.block_hash)
                   for index, tier in enumerate(self.tiers))

    def store(self, entries: Sequence[tuple[BlockKey, Payload]], sources: Mapping[BlockHash, int]) -> None:
        """Write blocks through to every tier that lacks them, except the tier each one came from."""
        for index, tier in enumerate(self.tiers):
            if tier.enabled:
                wanted = [(key, payload) for key, payload in entries
                          if sources.get(key.block_hash) != index and not tier.contains(key.block_hash)]
                if wanted:
                    tier.store(wanted)

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
