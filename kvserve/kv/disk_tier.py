"""The disk tier: one file per block under DIR/<fingerprint>/, LRU within a byte capacity.

Writes go through a background thread (the step loop only queues bytes it
already copied out of the pool); reads happen on the engine's thread when a
request's prefix continues here. Files are written to a temporary name and
renamed, so a finished name always held a complete file when it was written;
a crash, a full disk or a stray edit can still leave a bad one, which the
checksum catches when it is read (block_file.py).

Entries of another fingerprint (another model, KV dtype, block size or
layout) live in their own directory and are never read; they count against
the capacity and are the first to go when space is needed. The index is kept
in memory (key and size per block); LRU order survives restarts through file
modification times, which a hit refreshes.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvserve.errors import KVIntegrityError
from kvserve.kv import block_file
from kvserve.kv.hashing import BlockHash, hash_block
from kvserve.kv.tier import LOAD_SECONDS_BUCKETS, BlockKey, KVTier, Payload, TierStats

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    size: int  # file bytes


@dataclass(slots=True)
class _Counters:
    query_tokens: int = 0
    hit_tokens: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_evicted: int = 0
    bytes_evicted: int = 0
    writes_dropped: int = 0
    files_rejected: int = 0
    load_seconds_count: int = 0
    load_seconds_sum: float = 0.0


class DiskTier(KVTier):
    """Blocks of `payload_len` bytes (one block of `block_size` tokens, every layer) made under `fingerprint`."""

    def __init__(self, root: str | Path, capacity_bytes: int, fingerprint: bytes, block_size: int,
                 payload_len: int, max_pending_bytes: int = 256 * 2**20) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.payload_len = payload_len
        self.file_len = block_file.header_bytes_needed(block_size) + payload_len
        self.max_pending_bytes = max(max_pending_bytes, self.file_len)
        self.directory = self.root / fingerprint.hex()
        self.enabled = True
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self._bytes_used = 0
        self._foreign: list[tuple[float, str, int]] = []  # (mtime, path, size) of other fingerprints' files, oldest first
        self._pending: dict[BlockHash, tuple[BlockKey, Payload]] = {}  # queued for the writer
        self._pending_bytes = 0
        self._counters = _Counters()
        self._load_buckets = [0] * len(LOAD_SECONDS_BUCKETS)
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        try:
            self._open()
        except OSError as exc:
            self._disable(f"cannot use {self.root}: {exc}")
            return
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-kv-disk-writer", daemon=True)
        self._writer.start()
        # An owner that never calls close() (a script that just ends) still gets its queued blocks written.
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- startup ---------------------------------------------------------------------------------

    def _open(self) -> None:
        # Owner-only: the files hold K/V from which prompts can be partly reconstructed.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)
        probe = self.directory / f".probe-{os.getpid()}"
        probe.write_bytes(b"")  # unwritable: fail now, with the path in the message
        probe.unlink()
        started = time.perf_counter()
        rejected = self._index_own_files()
        self._index_foreign_files()
        with self._lock:
            self._evict_to_capacity()
        log.info("KV disk tier: %s, %d blocks (%.1f MiB) of this model and cache layout, capacity %.1f MiB, "
                 "indexed in %.2fs%s", self.directory, len(self._index), self._bytes_used / 2**20,
                 self.capacity_bytes / 2**20, time.perf_counter() - started,
                 f"; {rejected} bad file(s) removed" if rejected else "")

    def _index_own_files(self) -> int:
        found: list[tuple[float, _Entry]] = []
        rejected = 0
        needed = block_file.header_bytes_needed(self.block_size)
        # Blocks live in two-hex-digit subdirectories; anything else there (stored responses) is not ours.
        for path in self.directory.glob("??/*"):
            if ".tmp-" in path.name:
                _unlink(path)  # a write that never finished
                continue
            if not path.name.endswith(block_file.SUFFIX):
                continue
            try:
                stat = path.stat()
                with open(path, "rb") as file:
                    header = block_file.read_header(file.read(needed))
                self._check_header(header, path, stat.st_size)
            except (OSError, block_file.BlockFileError) as exc:
                log.warning("KV disk tier: removing %s: %s", path, exc)
                _unlink(path)
                rejected += 1
                continue
            found.append((stat.st_mtime, _Entry(header.key, stat.st_size)))
        found.sort(key=lambda item: item[0])
        for _, entry in found:
            self._index[entry.key.block_hash] = entry
            self._bytes_used += entry.size
        self._counters.files_rejected += rejected
        return rejected

    def _check_header(self, header: block_file.BlockFileHeader, path: Path, size: int) -> None:
        if header.fingerprint != self.fingerprint:
            raise block_file.BlockFileError("foreign file: another fingerprint")
        if path.name != header.key.block_hash.hex() + block_file.SUFFIX:
            raise block_file.BlockFileError("file name does not match the block hash inside")
        if len(header.key.token_ids) != self.block_size or header.payload_len != self.payload_len:
            raise block_file.BlockFileError("block shape differs from this cache's")
        if size != header.file_len:
            raise block_file.BlockFileError(f"{size} bytes, expected {header.file_len} (truncated)")

    def _index_foreign_files(self) -> None:
        for directory in self.root.iterdir():
            if directory == self.directory or not directory.is_dir():
                continue
            for path in directory.glob("??/*" + block_file.SUFFIX):
                try:
                    stat = path.stat()
                except OSError:
                    continue
                self._foreign.append((stat.st_mtime, str(path), stat.st_size))
                self._bytes_used += stat.st_size
        self._foreign.sort()

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
            counters = self._counters
            counters.hit_tokens += len(payloads) * self.block_size
            counters.load_seconds_count += 1
            counters.load_seconds_sum += elapsed
            slot = bisect.bisect_left(LOAD_SECONDS_BUCKETS, elapsed)
            if slot < len(self._load_buckets):
                self._load_buckets[slot] += 1
        return payloads

    def _read(self, key: BlockKey) -> Payload | None:
        path = self._path(key.block_hash)
        try:
            data = path.read_bytes()
            payload = block_file.decode(data, self.fingerprint, key, self.payload_len)
        except FileNotFoundError:  # evicted by the writer since the lookup
            self._forget(key.block_hash)
            return None
        except (OSError, block_file.BlockFileError) as exc:
            log.warning("KV disk tier: %s is unusable (%s); removed, the block will be recomputed", path, exc)
            self._forget(key.block_hash)
            _unlink(path)
            with self._lock:
                self._counters.files_rejected += 1
            return None
        with self._lock:
            if key.block_hash in self._index:
                self._index.move_to_end(key.block_hash)
            self._counters.blocks_read += 1
            self._counters.bytes_read += len(data)
        try:
            os.utime(path)  # LRU order that survives a restart
        except OSError:
            pass
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
            c = self._counters
            cumulative, running = [], 0
            for count in self._load_buckets:
                running += count
                cumulative.append(running)
            return TierStats(
                kind="disk", location=str(self.directory), enabled=self.enabled,
                capacity_bytes=self.capacity_bytes, bytes_used=self._bytes_used, num_blocks=len(self._index),
                pending_writes=len(self._pending), query_tokens=c.query_tokens, hit_tokens=c.hit_tokens,
                blocks_written=c.blocks_written, bytes_written=c.bytes_written, blocks_read=c.blocks_read,
                bytes_read=c.bytes_read, blocks_evicted=c.blocks_evicted, bytes_evicted=c.bytes_evicted,
                writes_dropped=c.writes_dropped, files_rejected=c.files_rejected,
                load_seconds_buckets=tuple(cumulative), load_seconds_count=c.load_seconds_count,
                load_seconds_sum=c.load_seconds_sum,
            )

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
            if sum(len(payload) for _, payload in self._pending.values()) != self._pending_bytes:
                raise KVIntegrityError("disk tier: queued payloads and the pending byte count disagree")
            # Every key, on disk or in flight to it, must be the chained digest of its own parent and
            # tokens: a key that is not would let one block's K/V be served for another's tokens.
            keys = [(h, e.key) for h, e in self._index.items()] + [(h, k) for h, (k, _) in self._pending.items()]
            for block_hash, key in keys:
                if key.block_hash != block_hash or len(key.token_ids) != self.block_size:
                    raise KVIntegrityError(f"disk tier: entry {block_hash.hex()} is filed under the wrong key")
                if hash_block(key.parent_hash, key.token_ids) != block_hash:
                    raise KVIntegrityError(f"disk tier: block {block_hash.hex()} does not hash to its name")
            for block_hash, (_, payload) in self._pending.items():
                if len(payload) != self.payload_len:
                    raise KVIntegrityError(f"disk tier: block {block_hash.hex()} in flight holds {len(payload)} "
                                           f"bytes, not {self.payload_len}")
            bad = next((h for h, e in self._index.items() if e.size != self.file_len), None)
            if bad is not None:
                raise KVIntegrityError(f"disk tier: block {bad.hex()} is indexed with a wrong file size")

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
        path = self._path(key.block_hash)
        temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(header)
                file.write(payload)  # not concatenated first: one copy less of 720 KiB
            os.replace(temporary, path)
        except OSError as exc:
            _unlink(temporary)
            self._disable(f"cannot write {path}: {exc}")
            with self._lock:
                self._counters.writes_dropped += 1
            return
        size = len(header) + len(payload)
        with self._lock:
            self._index[key.block_hash] = _Entry(key, size)
            self._bytes_used += size
            self._counters.blocks_written += 1
            self._counters.bytes_written += size
            self._evict_to_capacity()

    # -- helpers ---------------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + block_file.SUFFIX)

    def _evict_to_capacity(self) -> None:
        """Under the lock: drop other fingerprints' files, then our least recently used blocks."""
        while self._bytes_used > self.capacity_bytes and (self._foreign or self._index):
            if self._foreign:
                _, path, size = self._foreign.pop(0)
                _unlink(Path(path))
                self._bytes_used -= size
                self._counters.blocks_evicted += 1
                self._counters.bytes_evicted += size
            else:
                self._drop(next(iter(self._index)))

    def _drop(self, block_hash: BlockHash) -> None:
        """Under the lock: evict an indexed block (its file goes)."""
        entry = self._index.pop(block_hash)
        self._bytes_used -= entry.size
        self._counters.blocks_evicted += 1
        self._counters.bytes_evicted += entry.size
        _unlink(self._path(block_hash))

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            entry = self._index.pop(block_hash, None)
            if entry is not None:
                self._bytes_used -= entry.size

    def _disable(self, why: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
        log.error("KV disk tier DISABLED: %s. Serving goes on with the in-memory prefix cache only.", why)


def _close_at_exit(tier_ref: weakref.ref) -> None:
    tier = tier_ref()
    if tier is not None:
        tier.close()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
