"""The disk tier's files: its directory made ready, what it finds there at startup (its own block files,
checked, oldest first; other fingerprints' files, counted against the capacity and evicted first), and one
block file written so that a finished name always held a complete file."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import KVIntegrityError
from kvserve.kv import block_file
from kvserve.kv.hashing import BlockHash, hash_block
from kvserve.kv.tier import BlockKey

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


def write_atomically(path: Path, header: bytes, payload: bytes | memoryview) -> None:
    """Write a block file under a temporary name, then rename it; raises OSError, leaving no temporary."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(header)
            file.write(payload)  # not concatenated first: one copy less of 720 KiB
        os.replace(temporary, path)
    except OSError:
        unlink(temporary)
        raise


def scan_own_files(directory: Path, shape: BlockShape) -> tuple[list[DiskEntry], int]:
    """The usable block files under `directory`, least recently used first, and how many bad ones
    (unfinished writes aside) were removed."""
    found: list[tuple[float, DiskEntry]] = []
    rejected = 0
    needed = block_file.header_bytes_needed(shape.block_size)
    # Blocks live in two-hex-digit subdirectories; anything else there (stored responses) is not ours.
    for path in directory.glob("??/*"):
        if ".tmp-" in path.name:
            unlink(path)  # a write that never finished
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
                  shape: BlockShape, file_len: int) -> None:
    """Raise KVIntegrityError unless every indexed or queued block is filed under its own key, and sized right.

    Every key, on disk or in flight to it, must be the chained digest of its own parent and tokens: a key
    that is not would let one block's K/V be served for another's tokens."""
    keys = [(h, e.key) for h, e in index.items()] + [(h, k) for h, (k, _) in pending.items()]
    for block_hash, key in keys:
        if key.block_hash != block_hash or len(key.token_ids) != shape.block_size:
            raise KVIntegrityError(f"disk tier: entry {block_hash.hex()} is filed under the wrong key")
        if hash_block(key.parent_hash, key.token_ids) != block_hash:
            raise KVIntegrityError(f"disk tier: block {block_hash.hex()} does not hash to its name")
    for block_hash, (_, payload) in pending.items():
        if len(payload) != shape.payload_len:
            raise KVIntegrityError(f"disk tier: block {block_hash.hex()} in flight holds {len(payload)} "
                                   f"bytes, not {shape.payload_len}")
    bad = next((h for h, e in index.items() if e.size != file_len), None)
    if bad is not None:
        raise KVIntegrityError(f"disk tier: block {bad.hex()} is indexed with a wrong file size")
