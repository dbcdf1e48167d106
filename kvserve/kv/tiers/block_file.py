"""The on-disk format of one KV block: a fixed header, the key, a checksum, the K/V bytes.

Plain bytes, parsed field by field (no pickle: reading a file can never
execute code). Little-endian:

    magic         8 bytes   b"KVSBLK01": a token block; b"KVSBLK02": a compressed chunk's kept block
    fingerprint  16 bytes   what produced it (kvserve/kv/cache/fingerprint.py)
    block_hash   16 bytes
    parent_hash  16 bytes
    num_tokens    u32
    payload_len   u64
    extra_len     u32       (KVSBLK02 only)
    token_ids     num_tokens x i64
    extra_keys    extra_len bytes (KVSBLK02 only): what else the hash chains (BlockKey.extra_keys)
    checksum      u32       CRC-32 of everything above and the payload
    payload       payload_len bytes: the block's K/V, every layer

A kept block (KV compression, issue 43) says what it is: its rows are the tokens its chunk kept, not the K/V of
its token ids at their positions, and its key (hash, parent, tokens and extra keys, all checked on every read)
is the one a compressing request with the same prefix and spec looks up. A token block's file is as it was.

The header is enough to index a file at startup (key, size); the checksum is
verified whenever the payload is read, so a truncated or corrupted file is
caught before any of it reaches the pool. It guards against damage, not
forgery (the directory is owner-only, and what a block stands for is its key,
compared in full): CRC-32 catches every burst of up to 32 flipped bits and
reads a 720 KiB block in 0.11 ms, where BLAKE2b took 0.61 ms, most of a load.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvserve.kv.prefix.hashing import token_bytes, tokens_from_bytes
from kvserve.kv.tiers.connector import BlockKey

MAGIC = b"KVSBLK01"
MAGIC_KEPT = b"KVSBLK02"
SUFFIX = ".kvblock"
_FIXED = struct.Struct("<8s16s16s16sIQ")
_EXTRA_LEN = struct.Struct("<I")
_CHECKSUM = struct.Struct("<I")
_MAX_TOKENS = 1 << 16  # a block size above this is not a block: reject before allocating
MAX_EXTRA = 256  # a kept block's extra keys are 24 bytes (compressed_keys.py): more is not a block file


class BlockFileError(ValueError):
    """The bytes are not a valid block file for what was expected (the message says why)."""


@dataclass(frozen=True, slots=True)
class BlockFileHeader:
    fingerprint: bytes
    key: BlockKey
    payload_len: int
    header_len: int  # bytes before the payload (the checksum included)

    @property
    def file_len(self) -> int:
        return self.header_len + self.payload_len


def encode_header(fingerprint: bytes, key: BlockKey, payload: bytes | memoryview) -> bytes:
    """Everything before the payload (the checksum covers the payload too): a file is this, then the payload."""
    if len(key.extra_keys) > MAX_EXTRA:
        raise ValueError(f"{len(key.extra_keys)} bytes of extra keys: a block file holds at most {MAX_EXTRA}")
    magic = MAGIC_KEPT if key.extra_keys else MAGIC
    head = _FIXED.pack(magic, fingerprint, key.block_hash, key.parent_hash, len(key.token_ids), len(payload))
    if key.extra_keys:
        head += _EXTRA_LEN.pack(len(key.extra_keys))
    head += token_bytes(key.token_ids) + key.extra_keys
    return head + _CHECKSUM.pack(zlib.crc32(payload, zlib.crc32(head)))


def encode(fingerprint: bytes, key: BlockKey, payload: bytes | memoryview) -> bytes:
    """A whole block file."""
    return encode_header(fingerprint, key, payload) + payload


def read_header(data: bytes) -> BlockFileHeader:
    """Parse the header at the start of `data` (at least `header_len` bytes); raises BlockFileError."""
    if len(data) < _FIXED.size:
        raise BlockFileError(f"{len(data)} bytes: shorter than a block file header")
    magic, fingerprint, block_hash, parent_hash, num_tokens, payload_len = _FIXED.unpack_from(data)
    if magic not in (MAGIC, MAGIC_KEPT):
        raise BlockFileError("not a kvserve block file (or another format version)")
    if num_tokens > _MAX_TOKENS:
        raise BlockFileError(f"header claims {num_tokens} tokens")
    tokens_start, extra_len = _FIXED.size, 0
    if magic == MAGIC_KEPT:
        if len(data) < tokens_start + _EXTRA_LEN.size:
            raise BlockFileError("truncated inside the header")
        (extra_len,) = _EXTRA_LEN.unpack_from(data, tokens_start)
        if not 0 < extra_len <= MAX_EXTRA:
            raise BlockFileError(f"a kept block's header claims {extra_len} bytes of extra keys")
        tokens_start += _EXTRA_LEN.size
    tokens_end = tokens_start + 8 * num_tokens
    extra_end = tokens_end + extra_len
    if len(data) < extra_end + _CHECKSUM.size:
        raise BlockFileError("truncated inside the header")
    key = BlockKey(block_hash, parent_hash, tokens_from_bytes(data[tokens_start:tokens_end]),
                   bytes(data[tokens_end:extra_end]))
    return BlockFileHeader(fingerprint, key, payload_len, extra_end + _CHECKSUM.size)


def decode(data: bytes, fingerprint: bytes, key: BlockKey, payload_len: int) -> memoryview:
    """The payload of a whole block file (a view of `data`, not a copy), after checking that it is exactly
    what `key` names under `fingerprint`, complete, and intact. Raises BlockFileError otherwise."""
    header = read_header(data)
    if header.fingerprint != fingerprint:
        raise BlockFileError("written by another model or cache configuration (fingerprint differs)")
    if header.key != key:
        raise BlockFileError("holds another block (hash, parent or tokens differ)")
    if header.payload_len != payload_len:
        raise BlockFileError(f"payload of {header.payload_len} bytes, expected {payload_len}")
    if len(data) != header.file_len:
        raise BlockFileError(f"{len(data)} bytes, expected {header.file_len} (truncated or padded)")
    view = memoryview(data)
    checksum_at = header.header_len - _CHECKSUM.size
    payload = view[header.header_len :]
    if zlib.crc32(payload, zlib.crc32(view[:checksum_at])) != _CHECKSUM.unpack_from(data, checksum_at)[0]:
        raise BlockFileError("checksum mismatch (corrupted)")
    return payload


def header_bytes_needed(num_tokens: int, extra_len: int = 0) -> int:
    """How many leading bytes of a file hold the header of a block of `num_tokens` tokens (and `extra_len`
    bytes of extra keys: a kept block's)."""
    extra = _EXTRA_LEN.size + extra_len if extra_len else 0
    return _FIXED.size + extra + 8 * num_tokens + _CHECKSUM.size


def header_read_size(num_tokens: int) -> int:
    """Leading bytes to read to parse any header of a block of `num_tokens` tokens (a kept block's is longest)."""
    return header_bytes_needed(num_tokens, MAX_EXTRA)


def file_len(key: BlockKey, payload_len: int) -> int:
    """The size of the file that holds `key`'s block."""
    return header_bytes_needed(len(key.token_ids), len(key.extra_keys)) + payload_len
