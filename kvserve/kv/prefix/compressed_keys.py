"""Prefix-cache keys of a compressing request's blocks (KV compression, issue 43), one per slot block.

A compressed chunk's kept blocks depend on every token of the chunk and on the spec: kept block j of chunk k is
keyed by the previous slot block's key, the hash of the request's (spec-salted) token chain at the chunk's last
block, and j. A hit takes a chunk's kept blocks all or none, and counts the chunk's tokens. Blocks after the
compressed chunks chain from the compressed chain, one token block each: their K/V were computed over the kept
tokens, so no plain key may describe them. The spec is in the chain's salt (Request), so another spec, or none,
never meets these keys.

Blocks a compressing request keeps by position (a windowed group's, Gemma 3's local layers) and its recurrent-state
snapshots (a hybrid's) are keyed by `PositionKeys`: their K/V or state at position p were computed over the chunks
compressed before p, min(p // chunk, num_chunks) of them. Up to the end of the last compressed chunk's successor
that count follows from the position, and the spec-salted token chain's hash says the rest; past it, the count
depends on the prompt's length too, so the key says it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, overload

from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.prefix.hashing import BlockHash, BlockHashChain, hash_block


@dataclass(frozen=True, slots=True)
class SlotKey:
    """One slot block's key: its hash, its parent's, the tokens it is stored with (a kept block: the chunk's
    token block of the same index, for the pool's collision check), the tokens a hit through it covers,
    whether a hit may end there (not inside a chunk's kept blocks) and what else its hash chains (a kept
    block: its chunk and index, which a lower tier stores with it; a later block: nothing)."""

    block_hash: BlockHash
    parent: BlockHash
    token_ids: tuple[int, ...]
    end: int
    complete: bool
    extra: bytes = b""


def slot_keys(policy: ChunkPolicy, chain: BlockHashChain, token_ids: Sequence[int]) -> list[SlotKey]:
    """The keys of the slot blocks `chain` (the request's token chain) determines, in table order."""
    bs, hashes = chain.block_size, chain.hashes
    per_chunk, kept = policy.chunk // bs, policy.budget // bs
    keys: list[SlotKey] = []
    parent = chain.root
    for k in range(policy.num_chunks):
        last = (k + 1) * per_chunk - 1
        if last >= len(hashes):
            return keys
        for j in range(kept):
            first = (k * per_chunk + j) * bs
            tokens = tuple(token_ids[first : first + bs])
            extra = hashes[last] + b"kept" + j.to_bytes(4, "little")
            block_hash = hash_block(parent, tokens, extra)
            keys.append(SlotKey(block_hash, parent, tokens, (k + 1) * policy.chunk, j == kept - 1, extra))
            parent = block_hash
    for index in range(policy.num_chunks * per_chunk, len(hashes)):
        tokens = tuple(token_ids[index * bs : (index + 1) * bs])
        block_hash = hash_block(parent, tokens)
        keys.append(SlotKey(block_hash, parent, tokens, (index + 1) * bs, True))
        parent = block_hash
    return keys


class PositionKeys(Sequence[BlockHash]):
    """The keys of a compressing request's token blocks as kept by position (windowed groups' blocks, state
    snapshots), by block index like `chain.hashes`; each one computed when asked (none chains another)."""

    def __init__(self, policy: ChunkPolicy, chain: BlockHashChain) -> None:
        self.chain = chain
        self._first_counted = (policy.num_chunks + 1) * policy.chunk // chain.block_size
        self._extra = b"kv-compression:chunks" + policy.num_chunks.to_bytes(4, "little")

    def __len__(self) -> int:
        return len(self.chain.hashes)

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        block_hash = self.chain.hashes[index]
        return block_hash if index < self._first_counted else hash_block(block_hash, (), self._extra)

    def parent(self, index: int) -> BlockHash:
        return self[index - 1] if index else self.chain.root
