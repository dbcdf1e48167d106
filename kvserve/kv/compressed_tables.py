"""The KV manager's part of KV compression (issue 43): a compressing request's tables in slots.

Mixed into KVCacheManager (kv/manager.py), whose groups, pool and table updates it uses: when a request's tables
are to grow past a chunk it must compress (kv/compressed_chunks.py), the chunk's blocks are compacted first in every
full-attention group (the first budget / block_size of them keep the kept tokens, the rest go back to the pool) and
the runner is told to move the K/V (`take_compactions`). From then on those groups' tables count slots: a token at
position p sits at p - `dropped_tokens` there. Windowed groups (Gemma 3's local layers) keep positional tables (they
hold only their window, freed behind it by position) and a hybrid's recurrent state runs over every token, so each
group has its own offset (`slot_offsets`: 0 but for the full-attention groups).
"""

from __future__ import annotations

from typing import Sequence

from kvserve.arith import cdiv
from kvserve.errors import KVIntegrityError
from kvserve.kv.compressed_chunks import ChunkPolicy, Compaction
from kvserve.kv.manager_integrity import check_request_tables
from kvserve.kv.prefix.hashing import BlockHashChain
from kvserve.kv.prefix.prefix_cache import PrefixMatch


class CompressedTables:
    """KVCacheManager's compression methods (`self.compressed` holds the per-request record)."""

    @property
    def compressing_groups(self) -> tuple[int, ...]:
        """The KV groups whose tables a compressing request holds in slots: the full-attention ones."""
        return tuple(index for index, window in enumerate(self.group_windows) if window is None)

    def set_compression(self, request_id: str, policy: ChunkPolicy) -> None:
        """The request's prompt is compressed chunk by chunk, in the full-attention groups."""
        if not self.compressing_groups:
            raise ValueError("KV compression needs full-attention layers: every layer here has a sliding window")
        self.compressed.policies[request_id] = policy

    def forget_compression(self, request_id: str) -> None:
        self.compressed.forget(request_id)

    def dropped_tokens(self, request_id: str) -> int:
        """Tokens compression took out of the request's full-attention tables: its slot of position p is p - this."""
        return self.compressed.dropped(request_id)

    def slot_offsets(self, request_id: str) -> tuple[int, ...]:
        """Per KV group, the tokens its table of the request no longer holds (slot = position - this)."""
        dropped = self.compressed.dropped(request_id)
        return tuple(dropped if window is None else 0 for window in self.group_windows)

    def tier_loaded(self, request_id: str, token_ids: Sequence[int], block_hashes: BlockHashChain,
                    match: PrefixMatch, num_blocks: int) -> int:
        """Tokens the request's tables hold once its load delivered the first `num_blocks` blocks of `match`'s
        tier part (the rest are recomputed). A compressing request holds whole chunks only: where part of a
        chunk's kept blocks arrived, that chunk is computed again, so its blocks go back and its compressed
        chunks count up to there (the disk tier serves one-group models: kv/prefix/compressed_tier.py)."""
        num_tokens = self.prefix.tier_loaded_tokens(token_ids, block_hashes, match, num_blocks)
        if request_id in self.compressed and num_tokens < match.num_tokens:
            self.compressed.claim(request_id, num_tokens)
            self.prefix.cut(request_id, num_tokens // self.block_size)
            for group, offset in zip(self.groups, self.slot_offsets(request_id)):
                if dropped := group.cut(request_id, num_tokens - offset):
                    self.pool.free(reversed(dropped))
                    self._updates.changed(request_id)
        return num_tokens

    def peak_blocks_compressed(self, policy: ChunkPolicy, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks a request compressed by `policy` holds at once while it grows to `num_tokens` tokens
        (prompt and generated): its full-attention groups' kept slots (chunked prefill does not add to them: a
        step never crosses a compressed chunk's end), a windowed group's window as for any request."""
        return sum(cdiv(policy.peak_slots(num_tokens), self.block_size) if group.window is None
                   else group.peak_blocks(num_tokens, max_chunk_tokens) for group in self.groups)

    def take_compactions(self, request_id: str) -> tuple[Compaction, ...]:
        """The compactions planned for the request since the last call: the runner moves their K/V."""
        return self.compressed.take(request_id)

    def check_tables(self, request_id: str, num_computed_tokens: int) -> None:
        """A running request's tables (and state) fit its computed tokens, each group in its own slots
        (kv/manager_integrity.py)."""
        check_request_tables(self, request_id, num_computed_tokens, self.slot_offsets(request_id))

    def _blocks_needed(self, request_id: str, num_tokens: int, hit) -> list[int]:
        """Per group, the blocks to add for the request's tables to cover `num_tokens` tokens (positions), from
        its tables or, for a request that holds none, from its `hit` (PrefixMatch)."""
        tables = hit.tables if hit is not None else [group.tables.get(request_id, ()) for group in self.groups]
        return [max(self.blocks_for(num_tokens - offset) - len(table), 0)
                for offset, table in zip(self.slot_offsets(request_id), tables)]

    def _cut_point(self, request_id: str, num_tokens: int) -> int:
        """The most tokens, at most `num_tokens`, that every group and the recurrent state keep usable after a
        cut, each asked in its own table's coordinates; 0 where that falls inside a compressed chunk (the
        request starts again, uncompressed)."""
        offsets = (*self.slot_offsets(request_id), 0)  # the recurrent state counts positions
        floor = self.compressed.compressed_end(request_id)
        while num_tokens >= floor:
            kept = min(part.resumable_tokens(request_id, num_tokens - offset) + offset
                       for part, offset in zip(self._cut_parts, offsets))
            if kept == num_tokens:
                return kept
            num_tokens = kept  # every group (and the recurrent state) agrees on a cut point, or it moves back
        return 0

    def _compact_due(self, request_id: str, num_tokens: int, prefix) -> None:
        """Compact the chunks due before the request's tables cover `num_tokens` tokens (they free blocks only,
        so they are done whether or not the rest fits); a request that holds nothing yet starts from its
        `prefix` hit (PrefixMatch, or None)."""
        if request_id not in self.compressed:
            return
        if self.groups[0].tables.get(request_id):
            for chunk_index in self.compressed.due(request_id, num_tokens):
                self._compact(request_id, chunk_index)
        else:
            self.compressed.claim(request_id, prefix.num_tokens if prefix is not None else 0)

    def _compact(self, request_id: str, chunk_index: int) -> None:
        policy, bs = self.compressed.policies[request_id], self.block_size
        first = (chunk_index * policy.chunk - self.compressed.dropped(request_id)) // bs
        per_chunk, kept = policy.chunk // bs, policy.budget // bs
        tables = {index: self.groups[index].tables[request_id] for index in self.compressing_groups}
        for table in tables.values():
            src = table[first : first + per_chunk]
            if len(src) != per_chunk or any(block is None or block.ref_cnt != 1 for block in src):
                raise KVIntegrityError(f"request {request_id}: chunk {chunk_index} is not held whole and alone")
        compactions = []
        for index, table in tables.items():
            src = table[first : first + per_chunk]
            del table[first + kept : first + per_chunk]
            self.pool.free(reversed(src[kept:]))
            compactions.append(Compaction(chunk_index, chunk_index * policy.chunk,
                                          tuple(block.block_id for block in src), kept, index))
        self._updates.changed(request_id)
        self.compressed.compacted(request_id, chunk_index, compactions)
