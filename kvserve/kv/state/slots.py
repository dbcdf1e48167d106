"""The state slot pool: which slots are free, which are held, and which keep a snapshot for prefix hits.

A slot holds one request's recurrent state over every recurrent layer (kv/state/storage.py). It is held
(ref count > 0) by a running request as its live state or as a snapshot it wrote and has not yet given up;
a snapshot registered under the hash of the block it ends (kv/prefix/hashing.py) is found by later requests
whose prefix is that chain. A registered snapshot nobody holds stays findable until its slot is needed:
those are evicted least recently used first, as the pool's cached free blocks are.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import BlockHash


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.ref_cnt = [0] * num_slots
        self.key_of: list[BlockHash | None] = [None] * num_slots
        self.by_key: dict[BlockHash, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # never-used or forgotten slots (a stack)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # snapshots nobody holds, oldest first
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Slots an allocation can take: empty ones and snapshots nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_snapshots(self) -> int:
        return len(self.by_key)

    @property
    def num_held(self) -> int:
        return sum(1 for count in self.ref_cnt if count)

    def allocate(self) -> int | None:
        """A slot held once by the caller: an empty one, else the least recently used snapshot nobody
        holds (forgotten); None when every slot is held."""
        if self._free:
            slot = self._free.pop()
        elif self._evictable:
            slot, _ = self._evictable.popitem(last=False)
            self._forget(slot)
            self.num_evicted += 1
        else:
            return None
        self.ref_cnt[slot] = 1
        return slot

    def hold(self, slot: int) -> None:
        """Hold a registered snapshot (a prefix hit reads it); it is used, so it is the newest now."""
        self.ref_cnt[slot] += 1
        self._evictable.pop(slot, None)

    def release(self, slot: int) -> None:
        """Give up a hold; at zero, a registered snapshot becomes evictable (newest), anything else empty."""
        if self.ref_cnt[slot] <= 0:
            raise KVIntegrityError(f"state slot {slot} released more often than held")
        self.ref_cnt[slot] -= 1
        if self.ref_cnt[slot] == 0:
            if self.key_of[slot] is not None:
                self._evictable[slot] = None
            else:
                self._free.append(slot)

    def register(self, slot: int, key: BlockHash) -> bool:
        """Make the held `slot` the snapshot for the chain ending in block `key`; False if another slot
        already is (the caller keeps `slot` as it was)."""
        if key in self.by_key:
            return False
        if self.key_of[slot] is not None:
            del self.by_key[self.key_of[slot]]
        self.key_of[slot] = key
        self.by_key[key] = slot
        return True

    def unregister(self, slot: int) -> None:
        """The held `slot` is no longer findable (a request reuses it for something else)."""
        self._forget(slot)

    def lookup(self, key: BlockHash) -> int | None:
        return self.by_key.get(key)

    def _forget(self, slot: int) -> None:
        key = self.key_of[slot]
        if key is not None:
            del self.by_key[key]
            self.key_of[slot] = None

    def check_integrity(self, holders: Counter[int]) -> None:
        """Each slot's ref count equals its holders; every slot is held, evictable or free, exactly once."""
        for slot in range(self.num_slots):
            if self.ref_cnt[slot] != holders.get(slot, 0):
                raise KVIntegrityError(f"state slot {slot}: ref_cnt {self.ref_cnt[slot]}, "
                                       f"held {holders.get(slot, 0)} times")
        unheld = [slot for slot in range(self.num_slots) if not self.ref_cnt[slot]]
        if sorted([*self._free, *self._evictable]) != unheld:
            raise KVIntegrityError("the state slots' free and evictable lists disagree with their ref counts")
        if any(self.key_of[slot] is None for slot in self._evictable):
            raise KVIntegrityError("an evictable state slot keeps no snapshot")
        if any(self.key_of[slot] != key for key, slot in self.by_key.items()):
            raise KVIntegrityError("the state snapshot index disagrees with its slots")
