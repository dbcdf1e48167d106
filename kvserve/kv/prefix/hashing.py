"""Stable prefix-block hashes: the same tokens and salt give the same digest in every process.

A full block's hash is a digest of its parent block's hash, its token ids and
its extra keys (DESIGN §3). The chain's root is derived from the cache salt
(the first block's extra keys), so different salts never share a block.
Python's `hash()` changes with PYTHONHASHSEED; a disk tier, a restart or a
replica needs two processes to agree, so this is BLAKE2b over a fixed binary
encoding (token ids as little-endian int64). A digest can still collide in
principle: blocks keep their token ids and a lookup compares them.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

BlockHash = bytes  # a 16-byte digest

_DIGEST_SIZE = 16
_ROOT_PERSON = b"kvserve-root"  # domain separation: a root never equals a block hash
_BLOCK_PERSON = b"kvserve-block"
_BIG_ENDIAN = sys.byteorder == "big"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64: the one encoding hashes and block files share."""
    encoded = array("q", token_ids)
    if _BIG_ENDIAN:
        encoded.byteswap()
    return encoded.tobytes()


def tokens_from_bytes(data: bytes | memoryview) -> tuple[int, ...]:
    """The inverse of `token_bytes`."""
    decoded = array("q")
    decoded.frombytes(data)
    if _BIG_ENDIAN:
        decoded.byteswap()
    return tuple(decoded)


def chain_root(salt: str | None) -> BlockHash:
    """The parent hash of a chain's first block: the cache salt is the first block's extra key."""
    encoded = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8")  # None and "" differ
    return hashlib.blake2b(encoded, digest_size=_DIGEST_SIZE, person=_ROOT_PERSON).digest()


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """The one prefix-hash formula: digest(parent hash, token count, token ids, extra keys)."""
    return _hash_encoded(parent_hash, len(token_ids), token_bytes(token_ids), extra_keys)


_BLOCK_HASHER = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=_BLOCK_PERSON)  # copied: cheaper than building one


def _hash_encoded(parent_hash: BlockHash, num_tokens: int, tokens: bytes | memoryview, extra_keys: bytes) -> BlockHash:
    digest = _BLOCK_HASHER.copy()
    digest.update(parent_hash + num_tokens.to_bytes(4, "little") + tokens + extra_keys)
    return digest.digest()


class BlockHashChain:
    """A token sequence's full-block hashes, append-only, computed once as tokens arrive.

    `hashes[i]` is block i's hash (tokens [i*block_size, (i+1)*block_size));
    `parent(i)` the hash it chains from (the root for block 0). A chain made
    without a block size keeps no hashes (prefix caching off).
    """

    __slots__ = ("block_size", "root", "hashes", "compression")

    def __init__(self, block_size: int | None, salt: str | None = None) -> None:
        self.block_size = block_size
        self.root = chain_root(salt)
        self.hashes: list[BlockHash] = []
        # A compressing request's chunk geometry (kv/compressed_chunks.ChunkPolicy; its spec is in the salt): its
        # blocks are keyed per slot (kv/prefix/compressed_keys.py), not per token block.
        self.compression = None

    def __len__(self) -> int:
        return len(self.hashes)

    def parent(self, index: int) -> BlockHash:
        return self.hashes[index - 1] if index else self.root

    def extend(self, token_ids: Sequence[int]) -> None:
        """Hash the blocks of `token_ids` (the whole sequence so far) that became full since the last call."""
        bs = self.block_size
        if bs is None or len(token_ids) // bs <= len(self.hashes):
            return  # the common case on every decode step: no block filled
        start = len(self.hashes)
        end = len(token_ids) // bs
        # Encode the new tokens once and hash slices of that buffer, not one array per block.
        encoded = memoryview(token_bytes(token_ids[start * bs : end * bs]))
        width = bs * 8  # bytes per block: int64 token ids
        parent = self.parent(start)
        for offset in range(0, (end - start) * width, width):
            parent = _hash_encoded(parent, bs, encoded[offset : offset + width], b"")
            self.hashes.append(parent)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> BlockHashChain:
    """The chain of `token_ids`' full blocks (a convenience for callers that hold no request)."""
    chain = BlockHashChain(block_size, salt)
    chain.extend(token_ids)
    return chain
