"""Blocks between the pool and a lower tier, on the engine's thread (DESIGN §3, Tiers).

Before a step is scheduled, the requests about to be admitted have their
prefix match continued into the tier: the blocks found there are read,
checked, and written into free pool blocks, registered as cached. The
scheduler then finds them like any other cached prefix; it never learns
where they came from (the match only counts how many tokens were loaded, for
reporting). The pool tells it which blocks a step registered in the cache
(BlockStored events, kv/events.py); after the step they are copied out of the
pool and handed to the tier's background writer.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from kvserve.config import EngineConfig, parse_memory
from kvserve.engine.request import Request
from kvserve.kv.events import BlockStored, KVCacheEvent
from kvserve.kv.fingerprint import cache_fingerprint, tensor_digest
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import PagedKVCache
from kvserve.kv.tier_bridge import adopt_loaded, keys_after, room_for_loads
from kvserve.kv.tiers.connector import BlockKey, KVTier
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.stats import TierStats
from kvserve.model.loader import LoadedModel

log = logging.getLogger(__name__)


def open_disk_tier(config: EngineConfig, loaded: LoadedModel, kv_cache: PagedKVCache, kv_dtype: str) -> DiskTier:
    """The disk tier at `config.kv_disk_path`, filed under a fingerprint of this model and cache layout."""
    model = loaded.model
    weights = tensor_digest([*model.named_parameters(), *model.named_buffers()])
    fingerprint = cache_fingerprint(weights, {
        "model_config": loaded.config, "linear_dtype": loaded.linear_dtype, "kv_dtype": kv_dtype,
        "block_size": config.block_size, "block_layout": kv_cache.block_layout(),
    })
    return DiskTier(Path(config.kv_disk_path).expanduser(), parse_memory(config.kv_disk_size), fingerprint,
                    config.block_size, kv_cache.block_nbytes)


class TierTraffic:
    """Loads before scheduling, write-through after each step, for one engine's pool and tier."""

    def __init__(self, tier: KVTier, kv: KVCacheManager, kv_cache: PagedKVCache) -> None:
        if kv.num_groups > 1:
            raise ValueError("a lower tier holds the blocks of a single KV group")
        self.tier = tier
        self.kv = kv
        self.kv_cache = kv_cache
        # Blocks registered in the cache since the last write-through: what to write to the tier.
        self._newly_cached: list[tuple[int, BlockKey]] = []
        self._adopting = False  # blocks the tier itself is loading are in it already
        kv.pool.subscribe(self._on_cache_event)
        # request id -> (preemptions, hashed blocks, pool hit) when last looked up: a request waiting
        # for a slot is not looked up again every step unless something that matters changed.
        self._looked_up: dict[str, tuple[int, int, int]] = {}
        self.active = True  # False after an unexpected error: the engine goes on without the tier

    def load_for(self, candidates: list[Request]) -> None:
        """Continue the prefix match of the requests next in line into the tier and load what it holds,
        as far as free blocks allow without evicting what an earlier candidate loaded."""
        if self.active:
            self._guarded(self._load_for, candidates)

    def write_through(self) -> None:
        """Copy the blocks cached since the last call out of the pool and queue them for the tier."""
        cached, self._newly_cached = self._newly_cached, []
        if cached and self.active and self.tier.enabled:
            self._guarded(self._write_through, cached)

    def _on_cache_event(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored) and not self._adopting:
            self._newly_cached.append((event.block_id, BlockKey(event.block_hash, event.parent_hash,
                                                                event.token_ids)))

    def _guarded(self, work, argument) -> None:
        # A tier is an optimisation: a bug or an exhausted resource in it must never stop the step loop
        # (the pool is consistent either way: adopt_loaded registers nothing it did not fill).
        try:
            work(argument)
        except Exception:
            self.active = False
            log.exception("KV disk tier turned off after an unexpected error; serving goes on without it")

    def _load_for(self, candidates: list[Request]) -> None:
        budget = self.kv.num_free_blocks
        looked_up: dict[str, tuple[int, int, int]] = {}
        for request in candidates:
            budget -= self.kv.blocks_for(request.num_tokens)
            if budget < 0:
                break
            if request.sampling_params.skip_reading_prefix_cache:
                continue
            token_ids, chain = request.all_token_ids, request.block_hashes
            match = self.kv.find_cached_prefix(token_ids, chain)
            room = room_for_loads(self.kv, match)
            if room <= 0:
                continue  # not marked: looked up once blocks are free
            marker = (request.num_preemptions, len(chain), match.num_tokens)
            looked_up[request.request_id] = marker
            if self._looked_up.get(request.request_id) == marker:
                continue
            keys = keys_after(self.kv, token_ids, chain, match)
            held = min(self.tier.lookup(keys), room) if keys else 0
            if held <= 0:
                continue
            payloads = self.tier.load(keys[:held])
            if payloads:
                self._adopting = True
                try:
                    adopt_loaded(self.kv, match, keys[: len(payloads)],
                                 lambda block_ids: self.kv_cache.write_blocks(block_ids, payloads))
                finally:
                    self._adopting = False
        self._looked_up = looked_up

    def _write_through(self, cached: list[tuple[int, BlockKey]]) -> None:
        cached = [(block_id, key) for block_id, key in cached if not self.tier.contains(key.block_hash)]
        if cached:
            payloads = self.kv_cache.read_blocks([block_id for block_id, _ in cached])
            self.tier.store([(key, payload) for (_, key), payload in zip(cached, payloads)])

    def stats(self) -> TierStats:
        stats = self.tier.stats()
        return stats if self.active else dataclasses.replace(stats, enabled=False)

    def close(self) -> None:
        self.kv.pool.unsubscribe(self._on_cache_event)
        self.tier.close()
