"""The disk tier's files: its directory made ready, what it finds there at startup (its own block files,
checked, oldest first; other fingerprints' files, counted against the capacity and evicted first), and one
block file written so that a finished name always held a complete file.

Replicas on one host may share the directory (same model and layout, same fingerprint): each block has
one writer (its temporary name is created exclusively, and a finished file is never rewritten), any
replica reads any block (a lookup that misses a process's in-memory index reads the file's header and
indexes it: `read_entry`), and every load checks the checksum. Each process counts the files it indexed
against its capacity, so N sharing replicas keep at most about N capacities on disk; a file another
replica evicted is a miss, and a fresh temporary is never taken for a crashed write.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import BlockHash, hash_block
from kvserve.kv.tiers import block_file
from kvserve.kv.tiers.connector import BlockKey

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskEntry:
    key: BlockKey
    size: int  # file bytes


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What every block file of one tier directory must match."""

    fingerprint: bytes
    block_size: int
    payload_len: int


def block_path(directory: Path, block_hash: BlockHash) -> Path:
    """A block's file: in a subdirectory named by the hash's first two hex digits (no directory of millions)."""
    name = block_hash.hex()
    return directory / name[:2] / (name + block_file.SUFFIX)


def prepare_directory(root: Path, directory: Path) -> None:
    """Create the tier's directory, owner-only (the files hold K/V from which prompts can be partly
    reconstructed), and fail now, with the path in the message, if it cannot be written."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    probe = directory / f".probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


# A block file being written: one name per block, created exclusively, so that replicas sharing a directory
# never write one block twice at once. One left this long by a writer that died is removed.
_TEMPORARY = ".tmp-writing"
STALE_TEMPORARY_S = 60.0


def write_atomically(path: Path, header: bytes, payload: bytes | memoryview) -> bool:
    """Write a block file under a temporary name, then rename it; False (nothing written) if the block is on
    disk already or another process is writing it. Raises OSError, leaving no temporary of its own."""
    temporary = path.with_name(path.name + _TEMPORARY)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = _create_exclusively(temporary)
    if fd is None:
        return False
    try:
        # Checked once the temporary is ours: a writer that renamed before we created it is seen here,
        # and one that had not cannot have (its temporary would still be there): one writer per block.
        if path.exists():
            os.close(fd)
            unlink(temporary)
            return False
        with os.fdopen(fd, "wb") as file:
            file.write(header)
            file.write(payload)  # not concatenated first: one copy less of 720 KiB
        os.replace(temporary, path)
    except OSError:
        unlink(temporary)
        raise
    return True


def _create_exclusively(temporary: Path) -> int | None:
    """The temporary's descriptor, or None while another live writer holds it."""
    for _ in range(2):
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if not _is_stale(temporary):
                return None
            unlink(temporary)  # its writer died: take the block over
    return None


def _is_stale(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > STALE_TEMPORARY_S
    except OSError:
        return True  # gone since: free to take


def read_entry(directory: Path, key: BlockKey, shape: BlockShape) -> DiskEntry | None:
    """The entry of `key`'s file if another process (a replica sharing the directory) wrote it: its header
    read and checked against `key` (the payload's checksum is checked when it is loaded). None if absent
    or not this key's (a bad file is left to whoever reads it)."""
    path = block_path(directory, key.block_hash)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            header = block_file.read_header(file.read(block_file.header_read_size(shape.block_size)))
        check_header(header, shape, path, size)
    except (OSError, block_file.BlockFileError):
        return None
    return DiskEntry(header.key, size) if header.key == key else None


def open_directory(root: Path, directory: Path, shape: BlockShape
                   ) -> tuple[list[DiskEntry], int, list[tuple[float, str, int]]]:
    """Make the tier's directory ready and read what is there: our usable files (least recently used
    first), how many bad ones were removed, and other fingerprints' files (scan_foreign_files)."""
    prepare_directory(root, directory)
    entries, rejected = scan_own_files(directory, shape)
    return entries, rejected, scan_foreign_files(root, directory)


def scan_own_files(directory: Path, shape: BlockShape) -> tuple[list[DiskEntry], int]:
    """The usable block files under `directory`, least recently used first, and how many bad ones
    (unfinished writes aside) were removed."""
    found: list[tuple[float, DiskEntry]] = []
    rejected = 0
    needed = block_file.header_read_size(shape.block_size)
    # Blocks live in two-hex-digit subdirectories; anything else there (stored responses) is not ours.
    for path in directory.glob("??/*"):
        if ".tmp-" in path.name:
            if _is_stale(path):  # a write that never finished (a fresh one may be another replica's)
                unlink(path)
            continue
        if not path.name.endswith(block_file.SUFFIX):
            continue
        try:
            stat = path.stat()
            with open(path, "rb") as file:
                header = block_file.read_header(file.read(needed))
            check_header(header, shape, path, stat.st_size)
        except (OSError, block_file.BlockFileError) as exc:
            log.warning("KV disk tier: removing %s: %s", path, exc)
            unlink(path)
            rejected += 1
            continue
        found.append((stat.st_mtime, DiskEntry(header.key, stat.st_size)))
    found.sort(key=lambda item: item[0])
    return [entry for _, entry in found], rejected


def check_header(header: block_file.BlockFileHeader, shape: BlockShape, path: Path, size: int) -> None:
    if header.fingerprint != shape.fingerprint:
        raise block_file.BlockFileError("foreign file: another fingerprint")
    if path.name != header.key.block_hash.hex() + block_file.SUFFIX:
        raise block_file.BlockFileError("file name does not match the block hash inside")
    if len(header.key.token_ids) != shape.block_size or header.payload_len != shape.payload_len:
        raise block_file.BlockFileError("block shape differs from this cache's")
    if size != header.file_len:
        raise block_file.BlockFileError(f"{size} bytes, expected {header.file_len} (truncated)")


def scan_foreign_files(root: Path, own_directory: Path) -> list[tuple[float, str, int]]:
    """(mtime, path, size) of the block files of every other fingerprint under `root`, oldest first."""
    foreign = []
    for directory in root.iterdir():
        if directory == own_directory or not directory.is_dir():
            continue
        for path in directory.glob("??/*" + block_file.SUFFIX):
            try:
                stat = path.stat()
            except OSError:
                continue
            foreign.append((stat.st_mtime, str(path), stat.st_size))
    foreign.sort()
    return foreign


def unlink(path: Path) -> None:
    """Remove a file if it is there (a tier never fails over a file it meant to drop anyway)."""
    try:
        path.unlink()
    except OSError:
        pass


def check_entries(index: Mapping[BlockHash, DiskEntry], pending: Mapping[BlockHash, tuple[BlockKey, bytes | memoryview]],
                  pending_bytes: int, shape: BlockShape) -> None:
    """Raise KVIntegrityError unless every indexed or queued block is filed under its own key, and sized right,
    and the queued bytes add up to `pending_bytes`.

    Every key, on disk or in flight to it, must be the chained digest of its own parent, tokens and extra keys
    (a compressed chunk's kept block names its chunk there): a key that is not would let one block's K/V be
    served for another's tokens."""
    keys = [(h, e.key) for h, e in index.items()] + [(h, k) for h, (k, _) in pending.items()]
    for block_hash, key in keys:
        if key.block_hash != block_hash or len(key.token_ids) != shape.block_size:
            raise KVIntegrityError(f"disk tier: entry {block_hash.hex()} is filed under the wrong key")
        if hash_block(key.parent_hash, key.token_ids, key.extra_keys) != block_hash:
            raise KVIntegrityError(f"disk tier: block {block_hash.hex()} does not hash to its name")
    if sum(len(payload) for _, payload in pending.values()) != pending_bytes:
        raise KVIntegrityError("disk tier: queued payloads and the pending byte count disagree")
    for block_hash, (_, payload) in pending.items():
        if len(payload) != shape.payload_len:
            raise KVIntegrityError(f"disk tier: block {block_hash.hex()} in flight holds {len(payload)} "
                                   f"bytes, not {shape.payload_len}")
    bad = next((h for h, e in index.items() if e.size != block_file.file_len(e.key, shape.payload_len)), None)
    if bad is not None:
        raise KVIntegrityError(f"disk tier: block {bad.hex()} is indexed with a wrong file size")


def touch(path: Path) -> None:
    """Mark a file used now (its modification time orders LRU across restarts); a vanished file is no error."""
    try:
        os.utime(path)
    except OSError:
        pass
