"""What the block pool tells its subscribers about the prefix cache (vLLM's KV cache events).

A block enters the cache when it is full and registered under its hash
(`BlockStored`), leaves it when its content is evicted or rewritten
(`BlockRemoved`), and everything goes at once on a reset (`AllBlocksCleared`).
A lower tier subscribes to know what to write through (kv/tiers/traffic.py);
a replica will publish the same events to a cache-aware router, which is why
they carry vLLM's names and fields (hash, parent hash, token ids), plus the
KV group whose pages hold the block.

Callbacks run synchronously on the pool's thread, inside the pool call that
caused them: they must not call back into the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvserve.kv.prefix.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full, computed block registered in the cache under `block_hash`."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None  # the previous block's hash (the salt's chain root for a first block)
    token_ids: tuple[int, ...]
    group: int  # the KV group (kv/groups/layout.py) whose content it caches
    # The chain's first block: its parent is the salt's root, not a block (vLLM publishes no parent then).
    # Not compared: it follows from where the parent came from, which equality already checks.
    first: bool = field(default=False, compare=False)
    # What else the hash chains: empty for a token block; a compressed chunk's kept block names its chunk and
    # index (kv/prefix/compressed_keys.py), which a lower tier stores with it (kv/tiers/block_file.py).
    extra_keys: bytes = b""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's content left the cache: evicted for reuse, or rewritten in place."""

    block_hash: BlockHash
    group: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block left the cache at once."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventCallback = Callable[[KVCacheEvent], None]


class KVEventSubscribers:
    """The callbacks subscribed to one pool's events. Empty (and falsy) unless someone listens, so the
    pool builds no event on its hot paths for nobody."""

    def __init__(self) -> None:
        self._callbacks: list[KVEventCallback] = []

    def __bool__(self) -> bool:
        return bool(self._callbacks)

    def add(self, callback: KVEventCallback) -> None:
        self._callbacks.append(callback)

    def remove(self, callback: KVEventCallback) -> None:
        """Stop calling `callback` (a no-op if it is not subscribed)."""
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def emit(self, event: KVCacheEvent) -> None:
        for callback in self._callbacks:
            callback(event)
