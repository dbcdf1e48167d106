"""Where a compressing request's tables are cut (KV compression, issue 43), counted in slots, not tokens.

Mixed into KVCacheManager (kv/manager.py), whose groups, pool, prefix cache and compression record it uses. Two
cuts: a rollback (`truncate`: rejected drafts, forced tokens past a stop) falls after the whole compressed prompt,
since what is cut rides on a decode; a tier load that delivered part of a compressed chunk's kept blocks is cut
back to the chunk before it, which is then computed again.
"""

from __future__ import annotations

from typing import Sequence

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import BlockHashChain
from kvserve.kv.prefix.prefix_cache import PrefixMatch


class SlotCuts:
    """KVCacheManager's cuts of a compressing request's tables."""

    def _cut_offset(self, request_id: str, num_tokens: int) -> int:
        """The tokens KV compression dropped from the request's tables before a cut at token `num_tokens` (its
        slot is the token's position minus these). What is cut (rejected drafts, forced tokens past a stop)
        rides on a decode, after the whole prompt, so every compressed chunk is compressed and before the cut:
        a cut inside the compressed prompt would name slots no token count describes."""
        policy = self.compressed.policies.get(request_id)
        if policy is None:
            return 0
        offset = self.compressed.dropped(request_id)
        if offset != policy.num_chunks * policy.dropped_per_chunk or num_tokens < policy.num_chunks * policy.chunk:
            raise KVIntegrityError(f"request {request_id}: a cut at token {num_tokens} overlaps its compressed "
                                   f"prompt ({offset} of {policy.num_chunks * policy.dropped_per_chunk} tokens "
                                   f"dropped, chunks end at {policy.num_chunks * policy.chunk})")
        return offset

    def tier_loaded(self, request_id: str, token_ids: Sequence[int], block_hashes: BlockHashChain,
                    match: PrefixMatch, num_blocks: int) -> int:
        """Tokens the request's tables hold once its load delivered the first `num_blocks` blocks of `match`'s
        tier part (the rest are recomputed). A compressing request holds whole chunks only: where part of a
        chunk's kept blocks arrived, that chunk is computed again, so its blocks go back and its compressed
        chunks count up to there."""
        num_tokens = self.prefix.tier_loaded_tokens(token_ids, block_hashes, match, num_blocks)
        if request_id in self.compressed and num_tokens < match.num_tokens:
            self.compressed.claim(request_id, num_tokens)
            slots = num_tokens - self.compressed.dropped(request_id)
            self.prefix.cut(request_id, slots // self.block_size)
            for group in self.groups:
                if dropped := group.cut(request_id, slots):
                    self.pool.free(reversed(dropped))
                    self._updates.changed(request_id)
        return num_tokens
