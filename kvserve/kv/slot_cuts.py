"""Where a compressing request's tables are cut (KV compression, issue 43), counted in slots, not tokens.

Mixed into KVCacheManager (kv/manager.py), whose compression record it uses: a rollback (`truncate`: rejected
drafts, forced tokens past a stop) falls after the whole compressed prompt, since what is cut rides on a decode.
"""

from __future__ import annotations

from kvserve.errors import KVIntegrityError


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
