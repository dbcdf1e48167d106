"""The KV manager's part of KV compression (issue 43): a compressing request's tables in slots.

Mixed into KVCacheManager (kv/manager.py), whose groups, pool and table updates it uses: when a request's tables
are to grow past a chunk it must compress (kv/compressed_chunks.py), the chunk's blocks are compacted first (the
first budget / block_size of them keep the kept tokens, the rest go back to the pool) and the runner is told to
move the K/V (`take_compactions`). Everything the manager counts for such a request from then on is in slots.
"""

from __future__ import annotations

from kvserve.arith import cdiv
from kvserve.errors import KVIntegrityError
from kvserve.kv.compressed_chunks import ChunkPolicy, Compaction
from kvserve.kv.manager_integrity import check_request_tables


class CompressedTables:
    """KVCacheManager's compression methods (`self.compressed` holds the per-request record)."""

    def set_compression(self, request_id: str, policy: ChunkPolicy) -> None:
        """The request's prompt is compressed chunk by chunk (full attention, one group, no recurrent state)."""
        if self.group_windows != (None,) or self.states is not None:
            raise ValueError("KV compression applies to full-attention models (one group, no window or state)")
        self.compressed.policies[request_id] = policy

    def forget_compression(self, request_id: str) -> None:
        self.compressed.forget(request_id)

    def dropped_tokens(self, request_id: str) -> int:
        """Tokens compression took out of the request's tables: its slot of position p is p - this."""
        return self.compressed.dropped(request_id)

    def peak_blocks_compressed(self, policy: ChunkPolicy, num_tokens: int) -> int:
        """The most blocks a request compressed by `policy` holds at once while it grows to `num_tokens` tokens
        (prompt and generated; one group: compression refuses others). Chunked prefill does not add to it: a
        step never crosses a compressed chunk's end."""
        return cdiv(policy.peak_slots(num_tokens), self.block_size)

    def take_compactions(self, request_id: str) -> tuple[Compaction, ...]:
        """The compactions planned for the request since the last call: the runner moves their K/V."""
        return self.compressed.take(request_id)

    def check_tables(self, request_id: str, num_computed_tokens: int) -> None:
        """A running request's tables (and state) fit its computed tokens, in slots (kv/manager_integrity.py)."""
        check_request_tables(self, request_id, num_computed_tokens - self.compressed.dropped(request_id))

    def _compact_due(self, request_id: str, num_tokens: int, prefix) -> int:
        """Compact the chunks due before the request's tables cover `num_tokens` tokens (they free blocks only,
        so they are done whether or not the rest fits); a request that holds nothing yet starts from its
        `prefix` hit (PrefixMatch, or None). Returns the tokens dropped from its tables."""
        if request_id not in self.compressed:
            return 0
        if self.groups[0].tables.get(request_id):
            for chunk_index in self.compressed.due(request_id, num_tokens):
                self._compact(request_id, chunk_index)
        else:
            self.compressed.claim(request_id, prefix.num_tokens if prefix is not None else 0)
        return self.compressed.dropped(request_id)

    def _compact(self, request_id: str, chunk_index: int) -> None:
        policy, bs = self.compressed.policies[request_id], self.block_size
        table = self.groups[0].tables[request_id]
        first = (chunk_index * policy.chunk - self.compressed.dropped(request_id)) // bs
        src = table[first : first + policy.chunk // bs]
        if len(src) != policy.chunk // bs or any(block is None or block.ref_cnt != 1 for block in src):
            raise KVIntegrityError(f"request {request_id}: chunk {chunk_index} is not held whole and alone")
        kept = policy.budget // bs
        del table[first + kept : first + len(src)]
        self.pool.free(reversed(src[kept:]))
        self._updates.changed(request_id)
        self.compressed.compacted(request_id, Compaction(chunk_index, chunk_index * policy.chunk,
                                                         tuple(block.block_id for block in src), kept))
