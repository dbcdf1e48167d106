"""Per-tenant shares of the KV pool: whose cached blocks an allocation may evict. No tensors.

Every block belongs to the tenant that last allocated it (`KVBlock.tenant`), in use or free with its cached
prefix, pinned or not (pins count against their owner's share), until another allocation takes it. A
tenant's fair share is the pool x its weight / the weights of every tenant that holds blocks. With two or
more tenants holding blocks, an allocation takes free blocks in this order: blocks holding no prefix (they
cost nobody anything), then the least recently used cached block of the tenant furthest over its share.
And no tenant may evict another tenant's cached blocks that are within that tenant's share: to it they do
not count as free (`protected`), so its requests wait or preempt its own, and the other tenant's prefix
survives the flood. (Each can still grow to its own share: the shares add up to the pool.)

One tenant (every request anonymous, as without API keys) is the pool's plain LRU, unchanged.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping

from kvserve.kv.pool.free_queue import UNOWNED, FreeBlockQueue, KVBlock


class TenantQuota:
    """Blocks held and cached-free blocks per tenant, kept up to date by the pool (O(1) per block move)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.weights: dict[Hashable, float] = {}
        self.held: Counter = Counter({UNOWNED: num_blocks})  # blocks owned, in use or free
        self.cached_free: Counter = Counter()  # free blocks still holding the owner's prefix

    def set_weights(self, weights: Mapping[Hashable, float]) -> None:
        if any(not weight > 0 for weight in weights.values()):
            raise ValueError("a tenant's weight must be positive")
        self.weights = dict(weights)

    def weight(self, tenant: Hashable) -> float:
        return self.weights.get(tenant, 1.0)

    def tenants(self) -> list[Hashable]:
        """Tenants holding blocks."""
        return [tenant for tenant, count in self.held.items() if count > 0 and tenant != UNOWNED]

    @property
    def shared(self) -> bool:
        """Whether two or more tenants hold blocks (otherwise the pool is plain LRU)."""
        return len(self.tenants()) > 1

    def share(self, tenant: Hashable) -> float:
        """The tenant's fair share of the pool, in blocks, among the tenants holding blocks (and it)."""
        holders = set(self.tenants()) | {tenant}
        return self.num_blocks * self.weight(tenant) / sum(self.weight(t) for t in holders)

    def over(self, tenant: Hashable) -> float:
        return self.held[tenant] - self.share(tenant)

    def protected(self, tenant: Hashable) -> int:
        """Free blocks `tenant` may not take: other tenants' cached blocks within their shares. (It can still
        grow to its own share: the shares add up to the pool.)"""
        if not self.shared:
            return 0
        protected = 0
        for other, free in self.cached_free.items():
            if other != tenant and free > 0:
                protected += free - min(free, max(0, math.floor(self.over(other))))
        return protected

    def moved(self, block: KVBlock, tenant: Hashable) -> None:
        """A block handed out to `tenant` (its cached content already evicted)."""
        self.held[block.tenant] -= 1
        block.tenant = tenant
        self.held[tenant] += 1

    def choose(self, queue: FreeBlockQueue, tenant: Hashable) -> KVBlock | None:
        """The free block to hand `tenant` next (None: the queue's head, the plain LRU choice)."""
        if not self.shared or len(queue) == 0:
            return None
        candidates: dict[Hashable, KVBlock] = {}  # each owner's least recently used cached free block
        for block in queue:
            if block.block_hash is None:
                return block  # holds nothing: evicts nobody's prefix
            candidates.setdefault(block.tenant, block)
            if len(candidates) == sum(1 for free in self.cached_free.values() if free > 0):
                break
        return candidates[max(candidates, key=lambda owner: (self.over(owner), owner == tenant))]
