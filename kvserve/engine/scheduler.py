"""Continuous batching: which requests run this step, and how many tokens each. No tensors here.

One rule (DESIGN §3): each step gives requests tokens so that
`num_computed_tokens` catches up with `num_tokens`. Prefill, chunked prefill,
decode and recompute after preemption are all that rule.

Order within a step's token budget (`max_num_batched_tokens`) and sequence cap
(`max_num_seqs`): running requests that are decoding, then what is left (while
more than one request has work, no more than the engine's step-time target in
tokens, engine/step_budget.py) shared fairly between tenants
(engine/fair_share.py): each tenant's running requests
still prefilling (their next chunk), then its waiting requests by priority, first
come first served, while the pool keeps a watermark of free blocks. One tenant
alone (as without API keys) gets the whole budget in that order. When a running
request needs a block and none is free, the most recently admitted running request
of the tenant holding the most blocks is preempted (blocks freed, requeued at the
front, its tokens kept and recomputed later) and nobody new is admitted that step.

With `context_overflow="shift"`, a running request whose next token would lie
past `max_model_len` first drops half of its tokens after the first
`keep_tokens` (llama.cpp's context shift): the KV manager rewrites its table
and the step's output carries the K/V moves for the runner. A request that
reaches the limit while waiting is shifted by its tokens alone (it holds no
K/V) and recomputes the shorter context.

A waiting request whose prefix match continues in a lower tier (one lookup:
KVCacheManager.match_prefix) is given blocks for the whole match and set
aside, `loading`, while the runner reads the tier's blocks into them; it
computes nothing and is never preempted meanwhile (a read always ends). Once
the runner reports what arrived intact, it runs, from there on, like any
request with a prefix hit: what failed to arrive is recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kvserve.config import EngineConfig
from kvserve.engine.fair_share import FairShare, tenant_queues
from kvserve.engine.sample.constrained import with_forced
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput, scheduled_request
from kvserve.engine.step_budget import prefill_budget
from kvserve.kv.context_shift import shift_amount
from kvserve.kv.prefix.hashing import BlockHash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix.prefix_cache import PrefixMatch


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        # Where a context shift happens (None: never; requests that could get there were refused).
        self.shift_at = max_model_len if config.context_overflow == "shift" else None
        self.num_context_shifts = 0  # monotonic
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # Admitted, their blocks held, waiting for a tier's blocks (with the match they were admitted on).
        self.loading: dict[str, tuple[Request, PrefixMatch]] = {}
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # monotonic counters
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens served from the cache
        self.fair = FairShare()  # tenants' weights and tokens served
        # Tokens a step may take while several requests have work (engine/step_budget.py, set by the engine
        # from its measured steps; None: no cut).
        self.contended_budget: int | None = None

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: decodes first, then prefill chunks and admissions shared fairly by tenant."""
        out = SchedulerOutput()
        counts: dict[str, int] = {}  # request id -> tokens this step, in scheduling order
        budget = self.config.max_num_batched_tokens
        for request in [r for r in self.running if r.is_decoding]:
            if budget == 0:
                break
            count = self._give_running(request, budget, out, counts)
            self.fair.charge(request.tenant, count)
            budget -= count
        decodes = set(counts)
        busy = len(self.running) + len(self.waiting) > 1
        budget = prefill_budget(budget, self.config.max_num_batched_tokens, self.contended_budget if busy else None,
                                self.kv.block_size)
        prefilling = [r for r in self.running if not r.is_decoding]
        self.fair.begin_step({r.tenant for r in [*self.running, *self.waiting]})
        queues = tenant_queues(prefilling, self.waiting, lambda r: r.tenant, lambda r: r.priority)
        in_flight: list[set[BlockHash]] = []  # computed at the step's first admission

        def serve(request: Request, cap: int) -> int | None:
            if request.status is RequestStatus.RUNNING:
                return self._give_running(request, cap, out, counts)
            if request.status is not RequestStatus.WAITING:
                return 0
            if out.preempted:  # a step that had to preempt admits nobody
                return None
            if not in_flight:
                loading = [loaded for loaded, _ in self.loading.values()]
                in_flight.append(blocks_in_flight(self.kv, [*self.running, *loading]))
            return self._admit(request, cap, out, counts, in_flight[0])

        def token_out() -> bool:  # a prompt (or its recompute) reaches its last token in this step
            return any(self.requests[request_id].num_computed_tokens + count >= self.requests[request_id].num_tokens
                       for request_id, count in counts.items() if request_id not in decodes)

        self.fair.share(queues, budget, serve, lambda r: r.num_tokens - r.num_computed_tokens,
                        refill=lambda: not token_out())
        for request_id, count in counts.items():
            out.scheduled.append(scheduled_request(self.requests[request_id], count, self.kv))
        return out

    def _give_running(self, request: Request, budget: int, out: SchedulerOutput, counts: dict[str, int]) -> int:
        """Give a running request its tokens (at most `budget`), preempting while the pool runs dry
        (`FairShare.victim`). Returns the tokens it got (0: none, or it was preempted)."""
        if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
            return 0
        if self.shift_at is not None and request.num_tokens > self.shift_at:
            self._shift_running(request, out, counts)
            if request.status is not RequestStatus.RUNNING:
                return 0
        remaining = request.num_tokens - request.num_computed_tokens
        if request.draft_token_ids and (remaining != 1 or len(request.draft_token_ids) >= budget):
            request.draft_token_ids = []  # drafts ride on a decode, and only whole
        count = request.compression_stop(request.num_computed_tokens,
                                         with_forced(request, min(remaining, budget), remaining, budget))
        if count == 0:
            return 0  # its last token waits for room for its forced tokens
        count += len(request.draft_token_ids)
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + count,
                                         tenant=request.tenant):
            victim = self.fair.victim(self.running, lambda r: r.tenant, self.kv.num_blocks_held)
            self._preempt(victim, out)
            counts.pop(victim.request_id, 0)
            if victim is request:
                return 0
        counts[request.request_id] = count
        return count

    def _shift_running(self, request: Request, out: SchedulerOutput, counts: dict[str, int]) -> None:
        """Shift a running request's context, preempting (`FairShare.victim`) while the blocks it must copy do not fit."""
        keep, drop = shift_amount(self.config.keep_tokens, request.num_tokens)
        while (plan := self.kv.shift(request.request_id, keep, drop, request.num_computed_tokens)) is None:
            victim = self.fair.victim(self.running, lambda r: r.tenant, self.kv.num_blocks_held)
            self._preempt(victim, out)
            counts.pop(victim.request_id, 0)
            if victim is request:
                request.shift_context(keep, drop)  # nothing held: its shorter context is recomputed
                return
        request.shift_context(keep, drop)
        out.shifts.append((request.request_id, plan))
        self.num_context_shifts += 1

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, counts: dict[str, int],
               in_flight: set[BlockHash]) -> int | None:
        """Admit a waiting request with at most `budget` tokens if the sequence cap and the pool (its watermark,
        its tenant's share: under it, the tenant furthest over its share is preempted) allow; a prefix hit
        starts its progress above zero. Returns its tokens (0: it went to load a tier's blocks), or None: it
        waits, and its tenant's later requests with it (FCFS)."""
        if len(self.running) + len(self.loading) >= self.config.max_num_seqs:
            return None
        if self.shift_at is not None and request.num_tokens > self.shift_at:
            request.shift_context(*shift_amount(self.config.keep_tokens, request.num_tokens))  # preempted at the limit: no K/V to move
        # Preempted requests look up the cache too: their recompute is mostly hits.
        match = None
        if not request.sampling_params.skip_reading_prefix_cache:
            match = self.kv.match_prefix(request.all_token_ids, request.block_hashes)
            # The first block the pool lacks is being computed (or loaded) by another request.
            if self.kv.next_block_key(request.all_token_ids, request.block_hashes, match) in in_flight:
                return None  # it is admitted once the block is cached
            if match.num_tier_tokens:
                if not self._start_load(request, match, out):
                    return None
                in_flight |= self.kv.pending_block_keys(request.request_id, request.block_hashes,
                                                        request.num_prompt_tokens)
                return 0  # it computes nothing this step
        num_hit = match.num_tokens if match is not None else 0
        count = request.compression_stop(num_hit, with_forced(
            request, min(request.num_tokens - num_hit, budget), request.num_tokens - num_hit, budget))
        if count == 0:
            return None  # it waits for a step with room for its forced tokens
        # Room kept: the watermark (for running requests to grow) and the other tenants' shares.
        while not self.kv.allocate_slots(request.request_id, num_hit + count, bool(self.running), prefix=match,
                                         tenant=request.tenant):
            victim = self.fair.reclaim_victim(self.running, request.tenant, lambda r: r.tenant,
                                              self.kv.blocks_over_share)
            if victim is None:
                return None
            self._preempt(victim, out)
            counts.pop(victim.request_id, 0)
        request.num_computed_tokens = num_hit
        if match is not None:
            in_flight |= self.kv.pending_block_keys(request.request_id, request.block_hashes,
                                                    request.num_prompt_tokens)
        if request.num_cached_tokens is None:
            self._account_prompt(request, match)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        counts[request.request_id] = count
        return count

    def _start_load(self, request: Request, match: PrefixMatch, out: SchedulerOutput) -> bool:
        """Give a request blocks for its whole match and set it aside until its tier blocks arrive (False: no room)."""
        if not self.kv.allocate_slots(request.request_id, match.num_tokens, bool(self.running), prefix=match,
                                      tenant=request.tenant):
            return False
        request.num_computed_tokens = match.num_pool_tokens
        self.waiting.remove(request)
        request.status = RequestStatus.LOADING
        self.loading[request.request_id] = (request, match)
        out.loads.append(self.kv.tier_load(request.request_id, match))
        return True

    def finish_loads(self, delivered: Mapping[str, int]) -> None:
        """Loads ended, each with the number of its blocks that arrived intact (the runner copied them
        in): those count as computed and cached; the rest are recomputed. The requests run from now on."""
        for request_id, num_blocks in delivered.items():
            if request_id not in self.loading:
                continue  # aborted while its blocks were read
            request, match = self.loading.pop(request_id)
            request.num_computed_tokens = self.kv.tier_loaded(request_id, request.all_token_ids, request.block_hashes,
                                                              match, num_blocks)
            self.kv.cache_full_blocks(request_id, request.all_token_ids, request.block_hashes, request.num_computed_tokens)
            if request.num_cached_tokens is None:
                whole = request.num_computed_tokens == match.num_tokens
                self._account_prompt(request, match if whole else None, request.num_computed_tokens - match.num_pool_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _account_prompt(self, request: Request, match: PrefixMatch | None, num_tier_tokens: int = 0) -> None:
        """On first admission: the prefix-cache counters and the request's own account (`record_hit`)."""
        record_hit(request, match, self.kv, num_tier_tokens)
        self.prefix_cache_queries += request.num_prompt_tokens
        self.prefix_cache_hits += request.num_computed_tokens

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        out.shifts = [shift for shift in out.shifts if shift[0] != request.request_id]  # its blocks are gone
        self.kv.free(request.request_id)
        request.draft_token_ids = []  # (forced tokens stay: its grammar has consumed them)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    def advance(self, item: ScheduledRequest, num_accepted: int, num_kept: int) -> int:
        """Record a step's progress for one request whose accepted tokens (`num_accepted`, of which the
        output processor appended `num_kept` before any stop) are already in its token ids: its computed
        count, the blocks now full (cached) and the blocks behind a window (freed).

        Of the forced and draft tokens computed, only those that became the request's tokens hold valid
        K/V: the k-th accepted token is the k-th token fed after the last one, except the step's last
        accepted token, which was sampled and is computed next step. The blocks the others took are
        given back. Returns how many of the step's draft tokens were accepted."""
        request = self.requests[item.request_id]
        num_valid = min(num_kept, max(num_accepted - 1, 0))
        num_rejected = item.num_speculative_tokens - num_valid
        request.num_computed_tokens += item.num_new_tokens - num_rejected
        request.draft_token_ids = []
        if item.forced_token_ids:
            request.forced_token_ids = []  # now outputs (the engine puts the next ones on after this)
        if num_rejected:
            # The tables may keep less than asked (a cut inside a block others share): recompute from there.
            request.num_computed_tokens = self.kv.truncate(request.request_id, request.num_computed_tokens)
        self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.block_hashes,
                                  request.num_computed_tokens)
        # Cached first, then freed: a block behind a window stays hittable while the pool keeps it.
        self.kv.free_behind_window(request.request_id, request.num_computed_tokens)
        if num_kept and not self.config.enable_kv_cache:
            # No-cache baseline: forget everything, recompute the whole sequence next step.
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
        return max(num_valid - len(item.forced_token_ids), 0)

    def finish(self, request: Request, reason: str) -> None:
        """Finish (or abort) a request wherever it is; its blocks go back to the pool. Only the engine's
        retire() calls this: it also drops the request's state everywhere else."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.LOADING:
            del self.loading[request.request_id]  # the runner drops its read (Engine.retire)
        else:
            return
        request.kv_blocks_held = self.kv.num_blocks_held(request.request_id)
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]


def record_hit(request: Request, match: PrefixMatch | None, kv: KVCacheManager, num_tier_tokens: int) -> None:
    """A request's prefix-cache outcome on first admission, and where its prompt left the cache (explained
    against `match`, if the request's computed tokens are what it says)."""
    num_hit = request.num_computed_tokens
    request.num_cached_tokens = num_hit
    request.num_tier_cached_tokens = num_tier_tokens
    if match is not None and num_hit < request.num_prompt_tokens - 1:
        request.num_attention_cached_tokens = match.num_attention_tokens  # past num_hit: the state cut it
        request.prefix_divergence = kv.find_divergence(request.all_token_ids, match)


def blocks_in_flight(kv: KVCacheManager, requests: list[Request]) -> set[BlockHash]:
    """Blocks that requests still prefilling are about to compute: a waiting request that would compute
    the same block waits a step and then hits."""
    in_flight: set[BlockHash] = set()
    for request in requests:
        if not request.is_decoding:
            in_flight |= kv.pending_block_keys(request.request_id, request.block_hashes, request.num_prompt_tokens)
    return in_flight
