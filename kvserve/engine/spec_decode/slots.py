"""Where a step's drafts went in the KV cache: the slots written, how many were accepted, the slots rolled back.

The lab's cache map draws them. Taken around the scheduler's `advance()` (which truncates rejected drafts)
from the KV manager's block tables, for requests that carried drafts only: with drafting off, or a step
without drafts, nothing here runs. A compressing request's tables hold slots (KV compression, issue 43): its
draft at position p sits in slot p - the tokens compression dropped from its prompt, in each full-attention
group (a windowed group's tables keep positions).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.pool.block_updates import NULL_BLOCK_ID
from kvserve.kv.manager import KVCacheManager

Slot = tuple[int, int]  # (block id, offset of the token within the block)


@dataclass(frozen=True, slots=True)
class RequestDraftSlots:
    """One request's drafts in one step."""

    request_id: str
    num_written: int  # draft tokens whose K/V the step wrote
    num_accepted: int  # of those, accepted by the target model
    num_rolled_back: int  # of those, truncated: rejected, or accepted but cut (a stop, a shared block)
    written: tuple[Slot, ...]  # their slots, every KV group's (a model with sliding windows has several)
    rolled_back: tuple[Slot, ...]  # the written slots the rollback truncated
    freed_blocks: tuple[int, ...]  # blocks the rollback returned to the pool


@dataclass(frozen=True, slots=True)
class StepDrafts:
    """The drafts of the last step that ran a batch (`num_steps`), and totals since the engine started."""

    num_steps: int = 0
    requests: tuple[RequestDraftSlots, ...] = ()
    total_written: int = 0  # draft tokens (monotonic)
    total_accepted: int = 0
    total_rolled_back: int = 0
    total_freed_blocks: int = 0

    @property
    def num_written(self) -> int:
        return sum(r.num_written for r in self.requests)

    @property
    def num_accepted(self) -> int:
        return sum(r.num_accepted for r in self.requests)

    @property
    def num_rolled_back(self) -> int:
        return sum(r.num_rolled_back for r in self.requests)

    @property
    def num_freed_blocks(self) -> int:
        return sum(len(r.freed_blocks) for r in self.requests)


@dataclass(frozen=True, slots=True)
class PendingDrafts:
    """A request's draft slots as the step wrote them, before `advance()` rolls any back."""

    request_id: str
    first_position: int  # the first draft token's position in the sequence
    offsets: tuple[int, ...]  # per group, tokens KV compression dropped before it (slot = position - this)
    first_blocks: tuple[int, ...]  # per group, the index of its block in the group's table
    tables: tuple[tuple[int, ...], ...]  # every group's block ids from its first block on, before the rollback


class DraftSlotLog:
    """Collects the current step's RequestDraftSlots; `end_step` turns them into the step's StepDrafts."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.current = StepDrafts()
        self._step: list[RequestDraftSlots] = []

    def written(self, request_id: str, num_computed_tokens: int, num_new_tokens: int, num_drafts: int
                ) -> PendingDrafts:
        """Before `advance()`: the step computed `num_new_tokens` after `num_computed_tokens`, drafts last."""
        first_position = num_computed_tokens + num_new_tokens - num_drafts
        offsets = self.kv.slot_offsets(request_id)
        first_blocks = tuple((first_position - offset) // self.kv.block_size for offset in offsets)
        return PendingDrafts(request_id, first_position, offsets, first_blocks,
                             self._tails(request_id, first_blocks))

    def _tails(self, request_id: str, first_blocks: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Each group's block ids from its first block on: O(drafts), not O(context)."""
        start = min(first_blocks)
        return tuple(tuple(ids[first - start :])
                     for ids, first in zip(self.kv.block_ids(request_id, start), first_blocks))

    def settled(self, pending: PendingDrafts, num_drafts: int, num_accepted: int, num_computed_tokens: int) -> None:
        """After `advance()`: the request's K/V now covers `num_computed_tokens` tokens; what lay past them
        was rolled back."""
        size = self.kv.block_size
        positions = range(pending.first_position, pending.first_position + num_drafts)
        after = self._tails(pending.request_id, pending.first_blocks)
        written, rolled_back, freed = [], [], []
        for table, kept, offset, first in zip(pending.tables, after, pending.offsets, pending.first_blocks):
            for position in positions:
                index = position - offset
                slot = (table[index // size - first], index % size)
                written.append(slot)
                if position >= num_computed_tokens:
                    rolled_back.append(slot)
            # Blocks past the truncated table's end went back; drafts are never hashed or shared, so to the pool.
            freed += [block for block in table[len(kept):] if block != NULL_BLOCK_ID]
        num_rolled_back = sum(position >= num_computed_tokens for position in positions)
        self._step.append(RequestDraftSlots(pending.request_id, num_drafts, num_accepted, num_rolled_back,
                                            tuple(written), tuple(rolled_back), tuple(freed)))

    def end_step(self, num_steps: int) -> StepDrafts:
        """The step `num_steps` is over: its drafts become `current` (an empty list if it had none)."""
        step, self._step = tuple(self._step), []
        last = self.current
        self.current = StepDrafts(num_steps, step, last.total_written + sum(r.num_written for r in step),
                                  last.total_accepted + sum(r.num_accepted for r in step),
                                  last.total_rolled_back + sum(r.num_rolled_back for r in step),
                                  last.total_freed_blocks + sum(len(r.freed_blocks) for r in step))
        return self.current
