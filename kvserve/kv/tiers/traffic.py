"""Blocks between the pool and the tiers, on the engine's thread (DESIGN §3, Tiers): what each load
delivered, and the write-through of what the pool newly cached.

The pool tells which blocks a step registered in the cache (BlockStored
events, kv/events/events.py); after the step they are copied out of the pool and
handed to the tiers' background writers. A block a load just delivered is
registered too, like any block a request filled, but it is not written back
to the tier it came from: the load's result says where it came from.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvserve.kv.events.events import BlockStored, KVCacheEvent
from kvserve.kv.prefix.hashing import BlockHash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.cache.storage import PagedKVCache
from kvserve.kv.tiers.connector import BlockKey, LoadResult, TierConnector
from kvserve.kv.tiers.stats import TierStats

log = logging.getLogger(__name__)


class TierTraffic:
    """Load results in, write-through out, for one engine's pool and tiers."""

    def __init__(self, connector: TierConnector, kv: KVCacheManager, kv_cache: PagedKVCache) -> None:
        self.connector = connector
        self.kv = kv
        self.kv_cache = kv_cache
        # Blocks registered in the cache since the last write-through: what to write to the tiers.
        self._newly_cached: list[tuple[int, BlockKey]] = []
        # Blocks loads delivered since the last write-through: block hash -> the tier it came from.
        self._delivered: dict[BlockHash, int] = {}
        kv.pool.subscribe(self._on_cache_event)

    def loads_finished(self, results: Sequence[LoadResult]) -> dict[str, int]:
        """Per request, how many blocks its load delivered (the rest are recomputed). A tier whose load
        failed unexpectedly is turned off: a tier is an optimisation, and serving goes on without it."""
        delivered = {}
        for result in results:
            load = result.load
            if result.error is not None:
                self._turn_off(load.hit.tier, result.error)
            for key in load.hit.keys[: result.num_blocks]:
                self._delivered[key.block_hash] = load.hit.tier
            delivered[load.request_id] = result.num_blocks
        return delivered

    def write_through(self) -> None:
        """Copy the blocks cached since the last call out of the pool and queue them for the tiers."""
        cached, self._newly_cached = self._newly_cached, []
        delivered, self._delivered = self._delivered, {}
        if not cached:
            return
        try:
            wanted = [(block_id, key) for block_id, key in cached
                      if self.connector.wants(key, delivered.get(key.block_hash))]
            if wanted:
                payloads = self.kv_cache.read_blocks([block_id for block_id, _ in wanted])
                self.connector.store([(key, payload) for (_, key), payload in zip(wanted, payloads)], delivered)
        except Exception as exc:  # never stops the step loop (the pool is consistent either way)
            for index in range(len(self.connector.tiers)):
                self._turn_off(index, exc)

    def _on_cache_event(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            # A compressed chunk's kept block goes down as it is, its key naming its chunk (extra keys).
            self._newly_cached.append((event.block_id, BlockKey(event.block_hash, event.parent_hash,
                                                                event.token_ids, event.extra_keys)))

    def _turn_off(self, index: int, error: BaseException) -> None:
        tier = self.connector.tiers[index]
        if tier.enabled:
            log.error("KV %s tier turned off after an unexpected error; serving goes on without it", tier.name,
                      exc_info=error)
            tier.disable(f"{type(error).__name__}: {error}")

    def stats(self) -> TierStats:
        """The first tier's (the disk tier's) counters, for the engine's snapshot."""
        return self.connector.tiers[0].stats()

    def close(self) -> None:
        self.kv.pool.unsubscribe(self._on_cache_event)
        self.connector.close()
