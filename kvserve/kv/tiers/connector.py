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
from dataclasses import dataclass
from typing import Sequence

from kvserve.kv.hashing import BlockHash
from kvserve.kv.tiers.stats import TierStats

Payload = bytes | memoryview  # one block's K/V bytes, every layer (a view avoids copying 100s of KiB)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What identifies a full block's contents: its hash, the hash it chains from, and its tokens."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]


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
