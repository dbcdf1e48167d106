"""Physical KV blocks: ids, reference counts and the free queue.

Every block is created once, at startup. A block is either in use (ref_cnt > 0)
or in the free queue, never both. A full block can carry a hash (prefix
caching) and keeps it while free, until it is handed out again. The free queue
(kv/pool/free_queue.py) is ordered least recently used first. Subscribers hear
when a block enters or leaves the cache (kv/events/events.py).

Pinned blocks (a cache breakpoint with a TTL, kv/prefix/pins.py) hold no reference:
a reference would keep a block from every request, and a pool full of pins
would then stall running requests (SGLang's hard session pins deadlocked its
worker that way). Instead a free pinned block waits in a second free queue
that `allocate` reaches only once the ordinary one is empty: pins are evicted
last, never "never", and every free block stays allocatable.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from kvserve.errors import KVIntegrityError
from kvserve.kv.events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventCallback, KVEventSubscribers
from kvserve.kv.pool.free_queue import FreeBlockQueue, KVBlock
from kvserve.kv.pool.pool_integrity import check_pool_integrity
from kvserve.kv.pool.tenant_quota import TenantQuota
from kvserve.kv.prefix.hashing import BlockHash


class BlockPool:
    """All blocks, the free queue, and (with prefix caching) (group, hash) -> cached block.

    A cached block keeps its hash while free, so a later request can claim it
    back (`touch`); its hash is dropped only when the block is handed out anew.
    Blocks are pages of one KV group (kv/groups/layout.py); the same tokens are cached
    once per group, under the same hash.
    """

    def __init__(self, num_blocks: int, block_size: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[tuple[int, BlockHash], KVBlock] = {}
        # (group, parent hash) -> cached children: what lets a miss be explained to the token.
        self.children: dict[tuple[int, BlockHash | None], dict[BlockHash, KVBlock]] = {}
        self.num_cached_free_blocks = 0  # free blocks still holding a reusable prefix (kept up to date: O(1) stats)
        # Free blocks with pin_count > 0, handed out only when `free_queue` is empty (see the module doc).
        self.pinned_free_queue = FreeBlockQueue(())
        self.num_pinned_blocks = 0  # blocks with pin_count > 0, free or in use
        # Called with a pinned block that `allocate` is about to evict; it must drop every pin on it.
        self.on_pinned_evict: Callable[[KVBlock], None] | None = None
        self._subscribers = KVEventSubscribers()
        self.quota = TenantQuota(num_blocks)  # whose cached blocks an allocation may evict

    def subscribe(self, callback: KVEventCallback) -> None:
        """Call `callback` with every BlockStored / BlockRemoved / AllBlocksCleared from now on (kv/events/events.py)."""
        self._subscribers.add(callback)

    def unsubscribe(self, callback: KVEventCallback) -> None:
        self._subscribers.remove(callback)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.pinned_free_queue)

    def num_free_for(self, tenant: object, need_anyway: int | None = None) -> int:
        """Free blocks `tenant` may take (others' cached blocks within their shares are not: tenant_quota.py),
        or all of them for a need of `need_anyway` blocks that could never fit beside those shares (it must
        get in some time, as a request that needs the whole pool does past the watermark)."""
        protected = self.quota.protected(tenant)
        if need_anyway is not None and need_anyway > self.num_blocks - protected:
            protected = 0
        return self.num_free_blocks - protected

    def allocate(self, count: int, tenant: object = None) -> list[KVBlock]:
        """Take `count` free blocks for `tenant` (ref_cnt 1 each), evicting their cached content: the free
        queue's head (least recently used), or with several tenants the block tenant_quota.py chooses."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} are free")
        taken = []
        for _ in range(count):
            block = self._pop_free(tenant)
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
                self.quota.cached_free[block.tenant] -= 1
                self._evict(block)
            block.ref_cnt = 1
            self.quota.moved(block, tenant)
            taken.append(block)
        return taken

    def _pop_free(self, tenant: object) -> KVBlock:
        if len(self.free_queue):
            chosen = self.quota.choose(self.free_queue, tenant)
            if chosen is None:
                return self.free_queue.popleft()
            self.free_queue.remove(chosen)
            return chosen
        # Only pinned blocks are left: a request that needs a block wins over a pin. The pin lapses
        # (its owner unpins every block of it) before the block's content is evicted.
        block = self.pinned_free_queue.popleft()
        if self.on_pinned_evict is not None:
            self.on_pinned_evict(block)
        if block.pin_count:
            raise KVIntegrityError(f"block {block.block_id} is still pinned as it is evicted")
        return block

    def _queue_of(self, block: KVBlock) -> FreeBlockQueue:
        return self.pinned_free_queue if block.pin_count else self.free_queue

    def pin(self, block: KVBlock) -> None:
        """One more pin on a cached block; a free one moves to the pinned queue's tail."""
        if block.block_hash is None:
            raise KVIntegrityError(f"block {block.block_id} holds no prefix and cannot be pinned")
        if self._is_queued(block):
            self._queue_of(block).remove(block)
            block.pin_count += 1
            self.pinned_free_queue.append(block)
        else:
            block.pin_count += 1
        self.num_pinned_blocks += block.pin_count == 1

    def bump_pinned(self, block: KVBlock) -> None:
        """A refreshed pin's free block goes to the pinned queue's tail: the last to lapse under pressure."""
        if block.pin_count and self._is_queued(block):
            self.pinned_free_queue.remove(block)
            self.pinned_free_queue.append(block)

    def unpin(self, block: KVBlock) -> None:
        """Drop one pin; a free block with none left goes to the HEAD of the ordinary queue: nobody
        used it for its whole TTL, so it is the least recently used block there is."""
        if block.pin_count <= 0:
            raise KVIntegrityError(f"block {block.block_id} unpinned more often than pinned")
        queued = self._is_queued(block)
        if queued and block.pin_count == 1:
            self.pinned_free_queue.remove(block)
        block.pin_count -= 1
        self.num_pinned_blocks -= block.pin_count == 0
        if queued and block.pin_count == 0:
            self.free_queue.appendleft(block)

    @staticmethod
    def _is_queued(block: KVBlock) -> bool:
        return block.ref_cnt == 0 and block.prev_free is not None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on cached blocks, claiming free ones back from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
                    self.quota.cached_free[block.tenant] -= 1
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the free queue's tail.

        Callers pass a request's blocks tail-first, so the ends of block chains
        are reused before their roots.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue_of(block).append(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1
                    self.quota.cached_free[block.tenant] += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
                    token_ids: tuple[int, ...], group: int = 0, first: bool = False, extra_keys: bytes = b"") -> bool:
        """Register a full, computed (held) block of `group` under its hash; whether it was registered.
        If another block already holds the same content, that one stays the cached copy. `first`: the
        chain's first block (its parent hash is the salt's root), `extra_keys`: what else its hash chains (a
        compressed chunk's kept block: kv/prefix/compressed_keys.py), both for the events' subscribers."""
        if block.block_hash is not None or (group, block_hash) in self.cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids, block.group = block_hash, parent_hash, token_ids, group
        self.cached[group, block_hash] = block
        self.children.setdefault((group, parent_hash), {})[block_hash] = block
        if block.ref_cnt == 0:
            self.num_cached_free_blocks += 1
            self.quota.cached_free[block.tenant] += 1
        if self._subscribers:
            self._subscribers.emit(BlockStored(block.block_id, block_hash, parent_hash, token_ids, group, first,
                                               extra_keys))
        return True

    def uncache(self, block: KVBlock) -> None:
        """A held block's content is about to change (a context shift rewrites it in place): it leaves the
        cache, and any pin covering it lapses first."""
        if block.ref_cnt != 1:
            raise KVIntegrityError(f"block {block.block_id} is held {block.ref_cnt} times; only a block one "
                                   f"request holds alone may be rewritten")
        if block.block_hash is None:
            return
        if block.pin_count and self.on_pinned_evict is not None:
            self.on_pinned_evict(block)
        self._evict(block)

    def lookup(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int],
               group: int = 0) -> KVBlock | None:
        block = self.cached.get((group, block_hash))
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None  # absent, or a hash collision: never serve other tokens' K/V
        return block

    def cached_block(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        """The block caching `block_hash` in `group`, if any (no token check: for hashes of a known chain)."""
        return self.cached.get((group, block_hash))

    def children_of(self, parent_hash: BlockHash | None, group: int = 0) -> dict[BlockHash, KVBlock]:
        """The cached blocks of `group` whose parent is `parent_hash`."""
        return self.children.get((group, parent_hash), {})

    def reset_cache(self) -> bool:
        """Drop every cached prefix (pins lapse first); False, and nothing changes, while any block is in use
        (a running request's blocks must keep their hashes: vLLM's reset_prefix_cache has the same rule)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        subscribers, self._subscribers = self._subscribers, KVEventSubscribers()  # one event, not one per block
        try:
            for block in list(self.cached.values()):
                if block.pin_count and self.on_pinned_evict is not None:
                    self.on_pinned_evict(block)
                self._evict(block)
        finally:
            self._subscribers = subscribers
        self.num_cached_free_blocks = 0
        self.quota.cached_free.clear()
        if self._subscribers:
            self._subscribers.emit(AllBlocksCleared())
        return True

    def _evict(self, block: KVBlock) -> None:
        if self._subscribers and block.block_hash is not None:
            self._subscribers.emit(BlockRemoved(block.block_hash, block.group))
        del self.cached[block.group, block.block_hash]
        key = (block.group, block.parent_hash)
        siblings = self.children[key]
        del siblings[block.block_hash]
        if not siblings:
            del self.children[key]
        block.block_hash, block.parent_hash, block.token_ids, block.group = None, None, (), 0

    def check_integrity(self) -> None:
        """Raise KVIntegrityError (never a bare assert: `python -O` must not silence it) if the pool is inconsistent."""
        check_pool_integrity(self)
