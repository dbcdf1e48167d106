"""The disk tier: one file per block under DIR/<fingerprint>/, LRU within a byte capacity.

Writes go through a background thread (the step loop only queues bytes it
already copied out of the pool); loads run on the runner's reader thread
(reader.py), lookups on the engine's. Files are written to a temporary name and
renamed, so a finished name always held a complete file when it was written;
a crash, a full disk or a stray edit can still leave a bad one, which the
checksum catches when it is read (block_file.py).
Replicas on one host may share the directory (disk_files.py says how).

Entries of another fingerprint (another model, KV dtype, block size or
layout) live in their own directory and are never read; they count against
the capacity and are the first to go when space is needed. The index is kept
in memory (key and size per block); LRU order survives restarts through file
modification times, which a hit refreshes.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

from kvserve.errors import KVIntegrityError
from kvserve.kv.events.events import BlockRemoved, BlockStored, KVEventSubscribers
from kvserve.kv.prefix.hashing import BlockHash
from kvserve.kv.tiers import block_file
from kvserve.kv.tiers.connector import BlockKey, KVTier, Payload
from kvserve.kv.tiers.disk_files import (BlockShape, DiskEntry, block_path, check_entries, open_directory, read_entry,
                                         touch, unlink, write_atomically)
from kvserve.kv.tiers.stats import TierCounters, TierStats

log = logging.getLogger(__name__)

_STOP = object()


class DiskTier(KVTier):
    """Blocks of `payload_len` bytes (one block of `block_size` tokens, every layer) made under `fingerprint`."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, fingerprint: bytes, block_size: int,
                 payload_len: int, max_pending_bytes: int = 256 * 2**20) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.payload_len = payload_len
        self.file_len = block_file.header_bytes_needed(block_size) + payload_len  # a token block (a kept one: more)
        self.max_pending_bytes = max(max_pending_bytes, self.file_len)
        self.directory = self.root / fingerprint.hex()
        self._shape = BlockShape(fingerprint, block_size, payload_len)
        self.enabled = True
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, DiskEntry] = OrderedDict()  # least recently used first
        self._bytes_used = 0
        self._foreign: list[tuple[float, str, int]] = []  # (mtime, path, size) of other fingerprints' files, oldest first
        self._pending: dict[BlockHash, tuple[BlockKey, Payload]] = {}  # queued for the writer
        self._pending_bytes = 0
        self._counters = TierCounters()
        # Blocks landing on / leaving the disk (KV events, medium DISK): called under the lock, must only queue.
        self.subscribers = KVEventSubscribers()
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        try:
            self._open()
        except OSError as exc:
            self.disable(f"cannot use {self.root}: {exc}")
            return
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-disk-writer", daemon=True)
        self._writer.start()
        # An owner that never calls close() (a script that just ends) still gets its queued blocks written.
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- startup ---------------------------------------------------------------------------------

    def _open(self) -> None:
        started = time.perf_counter()
        entries, rejected, self._foreign = open_directory(self.root, self.directory, self._shape)
        for entry in entries:
            self._index[entry.key.block_hash] = entry
        self._bytes_used = sum(e.size for e in entries) + sum(size for _, _, size in self._foreign)
        self._counters.files_rejected += rejected
        with self._lock:
            self._evict_to_capacity()
        log.info("KV disk tier: %s, %d blocks (%.1f MiB) of this model and cache layout, capacity %.1f MiB, "
                 "indexed in %.2fs%s", self.directory, len(self._index), self._bytes_used / 2**20,
                 self.capacity_bytes / 2**20, time.perf_counter() - started,
                 f"; {rejected} bad file(s) removed" if rejected else "")

    # -- KVTier ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        if not self.enabled or not keys:
            return 0
        with self._lock:
            self._counters.query_tokens += len(keys) * self.block_size
            held = 0
            for key in keys:
                entry = self._index.get(key.block_hash)
                if entry is None or entry.key != key:  # absent, or a digest collision
                    break
                held += 1
        # A replica sharing the directory may have written what this process never indexed: look on disk.
        while held < len(keys) and (entry := read_entry(self.directory, keys[held], self._shape)) is not None:
            self._adopt(entry)
            held += 1
        return held

    def load(self, keys: Sequence[BlockKey]) -> list[Payload]:
        started = time.perf_counter()
        payloads: list[Payload] = []
        for key in keys:
            payload = self._read(key)
            if payload is None:
                break
            payloads.append(payload)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._counters.record_load(len(payloads) * self.block_size, elapsed)
        return payloads

    def _read(self, key: BlockKey) -> Payload | None:
        path = block_path(self.directory, key.block_hash)
        try:
            data = path.read_bytes()
            payload = block_file.decode(data, self.fingerprint, key, self.payload_len)
        except FileNotFoundError:  # evicted by the writer since the lookup
            self._forget(key.block_hash)
            return None
        except (OSError, block_file.BlockFileError) as exc:
            log.warning("KV disk tier: %s is unusable (%s); removed, the block will be recomputed", path, exc)
            self._forget(key.block_hash)
            unlink(path)
            with self._lock:
                self._counters.files_rejected += 1
            return None
        with self._lock:
            if key.block_hash in self._index:
                self._index.move_to_end(key.block_hash)
            self._counters.blocks_read += 1
            self._counters.bytes_read += len(data)
        touch(path)  # LRU order that survives a restart
        return payload

    def store(self, entries: Sequence[tuple[BlockKey, Payload]]) -> None:
        with self._lock:
            for key, payload in entries:
                if not self.enabled or self._pending_bytes + len(payload) > self.max_pending_bytes:
                    self._counters.writes_dropped += 1
                    continue
                if len(payload) != self.payload_len or len(key.token_ids) != self.block_size:
                    raise ValueError(f"a block of {len(key.token_ids)} tokens and {len(payload)} bytes does not fit "
                                     f"this tier ({self.block_size} tokens, {self.payload_len} bytes)")
                if key.block_hash in self._index or key.block_hash in self._pending:
                    continue
                self._pending[key.block_hash] = (key, payload)
                self._pending_bytes += len(payload)
                self._queue.put(key.block_hash)

    def evict(self, key: BlockKey) -> bool:
        with self._lock:
            entry = self._index.get(key.block_hash)
            if entry is None or entry.key != key:
                return False
            self._drop(key.block_hash)
        return True

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def stats(self) -> TierStats:
        with self._lock:
            return self._counters.snapshot("disk", str(self.directory), self.enabled, self.capacity_bytes,
                                           self._bytes_used, len(self._index), len(self._pending))

    def flush(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join()

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(entry.size for entry in self._index.values()) + sum(size for _, _, size in self._foreign)
            if total != self._bytes_used:
                raise KVIntegrityError(f"disk tier: entries add up to {total} bytes, the counter says {self._bytes_used}")
            if self._bytes_used > self.capacity_bytes:
                raise KVIntegrityError(f"disk tier holds {self._bytes_used} bytes, over its capacity {self.capacity_bytes}")
            check_entries(self._index, self._pending, self._pending_bytes, self._shape)

    # -- the writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                with self._lock:
                    key, payload = self._pending[item]
                if self.enabled:
                    self._write(key, payload)
                else:
                    with self._lock:
                        self._counters.writes_dropped += 1
                with self._lock:
                    self._pending.pop(item, None)
                    self._pending_bytes -= len(payload)
            finally:
                self._queue.task_done()

    def _write(self, key: BlockKey, payload: Payload) -> None:
        header = block_file.encode_header(self.fingerprint, key, payload)
        path = block_path(self.directory, key.block_hash)
        try:
            if not write_atomically(path, header, payload):  # on disk already, or another replica writes it
                self._adopt(read_entry(self.directory, key, self._shape))  # None while that write goes on
                return
        except OSError as exc:
            self.disable(f"cannot write {path}: {exc}")
            with self._lock:
                self._counters.writes_dropped += 1
            return
        size = len(header) + len(payload)
        with self._lock:
            self._counters.blocks_written += 1
            self._counters.bytes_written += size
        self._adopt(DiskEntry(key, size))

    def _adopt(self, entry: DiskEntry | None) -> None:
        """Index a block file now on disk (written here, or by a replica sharing the directory)."""
        with self._lock:
            if entry is None or (key := entry.key).block_hash in self._index:
                return
            self._index[key.block_hash] = entry
            self._bytes_used += entry.size
            if self.subscribers:
                self.subscribers.emit(BlockStored(-1, key.block_hash, key.parent_hash, key.token_ids, 0, False, key.extra_keys))
            self._evict_to_capacity()

    # -- helpers ---------------------------------------------------------------------------------

    def _evict_to_capacity(self) -> None:
        """Under the lock: drop other fingerprints' files, then our least recently used blocks."""
        while self._bytes_used > self.capacity_bytes and (self._foreign or self._index):
            if self._foreign:
                _, path, size = self._foreign.pop(0)
                unlink(Path(path))
                self._bytes_used -= size
                self._counters.blocks_evicted += 1
                self._counters.bytes_evicted += size
            else:
                self._drop(next(iter(self._index)))

    def _drop(self, block_hash: BlockHash) -> None:
        """Under the lock: evict an indexed block (its file goes)."""
        entry = self._unindex(block_hash)
        self._counters.blocks_evicted += 1
        self._counters.bytes_evicted += entry.size
        unlink(block_path(self.directory, block_hash))

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._unindex(block_hash)

    def _unindex(self, block_hash: BlockHash) -> DiskEntry | None:
        """Under the lock: a block leaves the index (its file is another matter)."""
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self._bytes_used -= entry.size
            if self.subscribers:
                self.subscribers.emit(BlockRemoved(block_hash, 0))
        return entry

    def disable(self, why: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
        log.error("KV disk tier DISABLED: %s. Serving goes on with the in-memory prefix cache only.", why)


def _close_at_exit(tier_ref: weakref.ref) -> None:
    tier = tier_ref()
    if tier is not None:
        tier.close()

