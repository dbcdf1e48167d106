"""What the scheduler hands the runner for one step: each request's tokens and block table changes, the
context shifts to apply, and the tier loads to start. Ids and counts only, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.kv.compressed_chunks import Compaction
from kvserve.kv.pool.block_updates import BlockTableUpdate
from kvserve.kv.context_shift import ShiftPlan
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.state.manager import StateStep
from kvserve.kv.tiers.connector import TierLoad


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's part of a step: the tokens computed now, in order. They end with `forced_token_ids`
    (outputs known without sampling) and then `draft_token_ids` (outputs guessed, to be verified); both
    follow the request's last token, and the step accepts a list of tokens for the request."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step, forced and draft tokens last
    num_computed_tokens: int  # tokens already cached before this step
    # Per KV group, how its block table changed since the runner last saw it (opaque ids from the KV
    # manager): the entries appended this step, or the whole table when it changed otherwise.
    block_update: BlockTableUpdate
    sample: bool  # whether this step reaches the end of the request's tokens (new tokens are accepted)
    forced_token_ids: tuple[int, ...] = ()
    draft_token_ids: tuple[int, ...] = ()
    state: StateStep | None = None  # a hybrid model's recurrent-state slots for this step (opaque ids)
    # KV compression (kv/compressed_chunks.py): chunks to compress before the forward, and per KV group the tokens
    # compression has dropped from the request's table once they are (its slot of position p is p - that).
    compactions: tuple[Compaction, ...] = ()
    slot_offsets: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens computed past the request's last token (forced and drafts): their K/V is kept only
        for those the step accepts."""
        return len(self.forced_token_ids) + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in scheduling order
    preempted: list[str] = field(default_factory=list)
    shifts: list[tuple[str, ShiftPlan]] = field(default_factory=list)  # K/V to move before the forward
    # Requests admitted this step whose prefix continues in a lower tier: the runner reads those blocks
    # off the compute thread into blocks the request holds; it runs once they have arrived.
    loads: list[TierLoad] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


def scheduled_request(request: Request, count: int, kv: KVCacheManager) -> ScheduledRequest:
    """What the runner needs of a request given `count` tokens this step (it lays the batch out in its
    backend's order): its tokens, its block table changes and (a hybrid model's) its state slots from `kv`."""
    start, drafts = request.num_computed_tokens, tuple(request.draft_token_ids)
    end = start + count - len(drafts)
    forced = tuple(request.forced_token_ids) if end > request.num_tokens else ()
    end -= len(forced)
    return ScheduledRequest(
        request.request_id,
        request.all_token_ids[start:end] + list(forced) + list(drafts),
        start,
        kv.take_block_updates(request.request_id),
        sample=end == request.num_tokens,
        forced_token_ids=forced,
        draft_token_ids=drafts,
        state=kv.state_step(request.request_id, start, count, len(forced) + len(drafts)),
        compactions=kv.take_compactions(request.request_id),
        slot_offsets=kv.slot_offsets(request.request_id),
    )
