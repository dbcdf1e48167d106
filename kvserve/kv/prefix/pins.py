"""Pinned prefixes: cache breakpoints with a TTL (DESIGN §3, Pins and sessions).

A pin names a prefix by its chain of block hashes (the chain already carries
the tenant's salt) and keeps its cached blocks "evicted last" until it
expires. It holds no block reference: a pinned block that nobody uses sits in
the pool's second free queue, which allocation reaches only when the ordinary
one is empty (kv/pool/block_pool.py). So:

- a running request always gets blocks: under pressure the pool evicts a
  pinned block, and the pin it belonged to lapses as a whole (the blocks
  after the evicted one could no longer be hit anyway);
- pins hold at most `max_pinned_blocks` (a share of the pool): a new pin that
  would go over it makes the least recently refreshed pins lapse first;
- a pin expires `ttl` seconds after it was last created or hit; `expire()`
  runs before every step, so none outlives its TTL by more than a step, and
  `check_integrity` fails if one did (a missed sweep) or if any block's pin
  count disagrees with the live pins.

The clock is injectable so tests move time instead of sleeping.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.errors import KVIntegrityError
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import KVBlock
from kvserve.kv.prefix.hashing import BlockHash

# Anthropic's cache_control TTLs; OpenAI's prompt_cache_retention values.
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0, "in-memory": 300.0, "24h": 86400.0}


@dataclass(frozen=True, slots=True)
class PinRequest:
    """Pin the request's prompt up to `num_tokens` (only whole blocks are pinned) for `ttl_s` seconds."""

    num_tokens: int
    ttl_s: float


# A cached block by its KV group and hash (kv/pool/block_pool.py).
CacheKey = tuple[int, BlockHash]


@dataclass(slots=True)
class _Pin:
    keys: tuple[CacheKey, ...]  # the prefix's cached blocks in every group, root first
    ttl_s: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class PinInfo:
    """One live pin as the stats snapshot shows it."""

    key: str  # hex of the pinned prefix's last block hash (short)
    num_blocks: int
    expires_in_s: float


@dataclass(frozen=True, slots=True)
class PinStats:
    num_pins: int
    num_pinned_blocks: int
    max_pinned_blocks: int
    pins_created: int  # monotonic
    pins_refreshed: int  # monotonic: a breakpoint or a prefix hit renewed a live pin's TTL
    pins_expired: int  # monotonic: their TTL ran out
    pins_lapsed: int  # monotonic: dropped early, for the cap or because a request needed their blocks
    cache_write_tokens: int  # monotonic: tokens written to the cache at breakpoints (see cache_write_tokens)
    pins: tuple[PinInfo, ...] = ()


def cache_write_tokens(breakpoint_tokens: int, num_cached_tokens: int, block_size: int) -> int:
    """Tokens a request writes to the cache at a breakpoint: the whole blocks up to it, less those it
    found cached already. The one formula the engine's counter and the APIs' usage share."""
    return max((breakpoint_tokens // block_size) * block_size - num_cached_tokens, 0)


class PinTable:
    """The live pins over one block pool. Not thread-safe: the engine's thread owns it."""

    def __init__(self, pool: BlockPool, max_pinned_blocks: int, clock: Callable[[], float] | None = None) -> None:
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.clock = clock or time.monotonic
        # Keyed by the last block hash (it names the whole chain); least recently refreshed first.
        self._pins: OrderedDict[BlockHash, _Pin] = OrderedDict()
        self._last_sweep = self.clock()
        self.pins_created = self.pins_refreshed = self.pins_expired = self.pins_lapsed = 0
        self.cache_write_tokens = 0
        pool.on_pinned_evict = self._on_evict

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, key: BlockHash, blocks_of: Sequence[CacheKey], ttl_s: float) -> int:
        """Pin the cached blocks `blocks_of` (root first; what a hit on the prefix needs, found by the KV
        manager), under `key`, the hash of the prefix's last block; or refresh the pin if it exists.
        Returns how many blocks the pin covers (0: none)."""
        blocks = [self.pool.cached[cache_key] for cache_key in blocks_of]
        if not blocks:
            return 0
        now = self.clock()
        pin = self._pins.get(key)
        if pin is not None:
            self._refresh(key, pin, now, ttl_s)
            return len(pin.keys)
        if len(blocks) > self.max_pinned_blocks:
            return 0  # larger than the whole share pins may hold: it would only push every other pin out
        while self.pool.num_pinned_blocks + sum(1 for b in blocks if not b.pin_count) > self.max_pinned_blocks:
            self._drop(next(iter(self._pins)))  # the least recently refreshed pin lapses first
            self.pins_lapsed += 1
        for block in reversed(blocks):  # chain ends nearer the pinned queue's head than their roots
            self.pool.pin(block)
        self._pins[key] = _Pin(tuple(blocks_of), ttl_s, now + ttl_s)
        self.pins_created += 1
        return len(blocks)

    def refresh_hit(self, blocks: Sequence[KVBlock]) -> None:
        """A request's prefix hit `blocks`: every pin that ends among them is renewed for its own TTL."""
        if not self._pins or not any(block.pin_count for block in blocks):
            return
        now = self.clock()
        for block in blocks:
            pin = self._pins.get(block.block_hash) if block.pin_count else None
            if pin is not None:
                self._refresh(block.block_hash, pin, now, pin.ttl_s)

    def _refresh(self, key: BlockHash, pin: _Pin, now: float, ttl_s: float) -> None:
        pin.ttl_s = max(pin.ttl_s, ttl_s)
        pin.expires_at = max(pin.expires_at, now + ttl_s)
        self._pins.move_to_end(key)
        for cache_key in reversed(pin.keys):
            self.pool.bump_pinned(self.pool.cached[cache_key])
        self.pins_refreshed += 1

    def expire(self) -> int:
        """Drop every pin whose TTL ran out; returns how many. O(pins): there are few."""
        now = self._last_sweep = self.clock()
        expired = [key for key, pin in self._pins.items() if pin.expires_at <= now]
        for key in expired:
            self._drop(key)
        self.pins_expired += len(expired)
        return len(expired)

    def _drop(self, key: BlockHash) -> None:
        pin = self._pins.pop(key)
        # Root first: each unpinned free block goes to the ordinary queue's head, so the chain's end
        # ends up first in line and its root last (as a finished request frees, tail first).
        for cache_key in pin.keys:
            self.pool.unpin(self.pool.cached[cache_key])  # a pinned block keeps its hash until it is unpinned

    def _on_evict(self, block: KVBlock) -> None:
        """The pool is evicting a pinned block for a request: every pin that covers it lapses."""
        evicted = (block.group, block.block_hash)
        for key in [key for key, pin in self._pins.items() if evicted in pin.keys]:
            self._drop(key)
            self.pins_lapsed += 1

    def stats(self) -> PinStats:
        now = self.clock()
        return PinStats(
            len(self._pins), self.pool.num_pinned_blocks, self.max_pinned_blocks, self.pins_created,
            self.pins_refreshed, self.pins_expired, self.pins_lapsed, self.cache_write_tokens,
            tuple(PinInfo(key.hex()[:12], len(pin.keys), max(pin.expires_at - now, 0.0))
                  for key, pin in self._pins.items()))

    def check_integrity(self) -> None:
        """Every block's pin count equals the live pins covering it; no pin outlived the last sweep;
        pins stay within their share of the pool. Raises KVIntegrityError otherwise."""
        covering: Counter[int] = Counter()
        for key, pin in self._pins.items():
            if pin.expires_at <= self._last_sweep:
                raise KVIntegrityError(f"pin {key.hex()[:12]} expired before the last sweep but still holds "
                                       f"{len(pin.keys)} blocks")
            for cache_key in pin.keys:
                block = self.pool.cached.get(cache_key)
                if block is None:
                    raise KVIntegrityError(f"pin {key.hex()[:12]} covers a block that is no longer cached")
                covering[block.block_id] += 1
        for block in self.pool.blocks:
            if block.pin_count != covering.get(block.block_id, 0):
                raise KVIntegrityError(f"block {block.block_id}: pin_count {block.pin_count}, covered by "
                                       f"{covering.get(block.block_id, 0)} pins")
        if self.pool.num_pinned_blocks > self.max_pinned_blocks:
            raise KVIntegrityError(f"{self.pool.num_pinned_blocks} blocks pinned, over the cap of "
                                   f"{self.max_pinned_blocks}")
