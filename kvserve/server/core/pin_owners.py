"""Whose pin is whose: the tenant that asked for each pinned prefix, so /v1/kv_cache shows a tenant
its own pins and nothing of another's.

The engine's snapshot names a pin by the hash of its prefix's last block (kv/pins.PinInfo.key) and
knows nothing of tenants. A tenant's chain is rooted in its salt (core/tenancy.py), so that hash is
the tenant's alone: when a request with cache breakpoints is admitted, the hash each breakpoint will
be pinned under is computed here (the same chain the engine computes) and filed under the tenant.
An entry lives while its pin does, or for the longest TTL after it was filed (the pin may not exist
yet: the request may still wait or prefill); past MAX_ENTRIES the oldest pinless entries go first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvserve.kv.prefix.hashing import block_hashes
from kvserve.kv.prefix.pins import TTL_SECONDS, PinRequest

MAX_ENTRIES = 100_000
_LONGEST_TTL_S = max(TTL_SECONDS.values())


def pin_key(block_hash: bytes) -> str:
    """How the snapshot spells a pin's key (kv/prefix/pins.py: the hash's first 12 hex digits)."""
    return block_hash.hex()[:12]


class PinOwners:
    """Thread-safe: filed from the preprocessing pool, read on the event loop."""

    def __init__(self, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.clock = clock
        self._owners: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (tenant, filed at)
        self._lock = threading.Lock()

    def file(self, tenant: str, token_ids: Sequence[int], salt: str | None, pins: Sequence[PinRequest],
             live_keys: Iterable[str]) -> None:
        """(worker) File the keys `pins` of a prompt will be pinned under as `tenant`'s."""
        if not pins:
            return
        chain = block_hashes(token_ids[: max(p.num_tokens for p in pins)], self.block_size, salt)
        keys = [pin_key(chain.hashes[p.num_tokens // self.block_size - 1]) for p in pins
                if p.num_tokens >= self.block_size]
        now = self.clock()
        with self._lock:
            for key in keys:
                self._owners[key] = (tenant, now)
                self._owners.move_to_end(key)
            if len(self._owners) > MAX_ENTRIES:
                self._prune(set(live_keys), now)

    def owner(self, key: str) -> str | None:
        """The tenant that asked for the pin named `key` (None: not one filed here)."""
        with self._lock:
            entry = self._owners.get(key)
        return entry[0] if entry is not None else None

    def _prune(self, live: set[str], now: float) -> None:
        for key, (_, filed_at) in list(self._owners.items()):
            if key not in live and now - filed_at > _LONGEST_TTL_S:
                del self._owners[key]
        for key in list(self._owners):  # still too many: the oldest pinless ones go
            if len(self._owners) <= MAX_ENTRIES:
                break
            if key not in live:
                del self._owners[key]
