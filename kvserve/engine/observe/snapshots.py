"""The engine's current stats snapshot and the counters it is built from (engine/observe/stats.py builds one).

Every step, add and abort ends with a new snapshot swapped in with one
assignment; readers on other threads only ever read `current`.
"""

from __future__ import annotations

from kvserve.engine.sample.constrained import ConstrainedRequests
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.spec_decode.slots import DraftSlotLog
from kvserve.engine.spec_decode.counters import DraftCounters
from kvserve.engine.observe.kept_tokens import KeptTokens
from kvserve.engine.observe.stats import BlockView, EngineStats, StepWork, take_block_view, take_stats, with_added
from kvserve.kv.tiers.traffic import TierTraffic


class SnapshotKeeper:
    """Counts steps and generated tokens, remembers the last step's work, and builds the lab's BlockView
    only when asked (it is O(blocks))."""

    def __init__(self, scheduler: Scheduler, tiering: TierTraffic | None,
                 drafts: DraftCounters | None = None, draft_slots: DraftSlotLog | None = None,
                 constrained: ConstrainedRequests | None = None) -> None:
        self.scheduler = scheduler
        self.constrained = constrained
        self.tiering = tiering
        self.drafts = drafts
        self.draft_slots = draft_slots
        self.num_steps = self.num_generated_tokens = 0
        self.last_step = StepWork()
        self._block_view: BlockView | None = None  # the last one built, carried into later snapshots
        self._block_view_wanted = self._block_view_current = False
        self.kept_tokens = KeptTokens()  # which tokens KV compression kept, for the lab (off until it enables it)
        self.current = self.take()

    def record_step(self, work: StepWork, num_generated_tokens: int) -> None:
        self.num_steps += 1
        self.num_generated_tokens += num_generated_tokens
        self.last_step = work
        if self.draft_slots is not None:
            self.draft_slots.end_step(self.num_steps)

    def take(self) -> EngineStats:
        """A new snapshot after the pool changed (a step, an abort); it becomes `current`."""
        # Every snapshot but an add's follows a change of the pool: the view is current only if it was
        # built in this one.
        self._block_view_current = self._block_view_wanted
        if self._block_view_wanted:
            self._block_view_wanted = False
            # With the draft slots of the same step: the map draws them on the blocks as they were then.
            drafts = self.draft_slots.current if self.draft_slots is not None else None
            self._block_view = take_block_view(self.scheduler.kv, self.num_steps, drafts)
        tier = self.tiering.stats() if self.tiering is not None else None
        self.current = take_stats(self.scheduler, self.num_steps, self.num_generated_tokens, self.last_step,
                                  self._block_view, tier, pins=self.scheduler.kv.pin_stats(),
                                  spec_decode=self.drafts.snapshot() if self.drafts is not None else None,
                                  draft_slots=self.draft_slots.current if self.draft_slots is not None else None,
                                  structured=self.constrained.snapshot() if self.constrained is not None else None)
        return self.current

    def added(self, request: Request) -> None:
        self.current = with_added(self.current, request, self.scheduler.kv)
        if request.compression is not None:
            self.kept_tokens.start(request.request_id, request.num_prompt_tokens, request.compression.num_chunks)

    def want_block_view(self, idle: bool) -> None:
        """Have the next snapshot carry a fresh BlockView. An idle engine takes it at once, since no step
        will come to take it; if nothing changed since its last view, that one stays (readers can tell
        by identity that nothing is new)."""
        if not idle:
            self._block_view_wanted = True
        elif not self._block_view_current:  # idle, and the pool changed since the last view
            self._block_view_wanted = True
            self.take()
