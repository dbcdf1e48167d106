"""The step loop: add requests, step (schedule -> run -> accept -> advance), abort, retire."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from kvserve.config import EngineConfig
from kvserve.engine.compression import RequestCompression
from kvserve.engine.breakpoints import PendingBreakpoints, check_breakpoints
from kvserve.engine.sample.constrained import ConstrainedRequests
from kvserve.engine.spec_decode.drafting import Proposer
from kvserve.engine.fault_isolation import execute_isolating_failures
from kvserve.engine.observe.integrity import check_engine_integrity
from kvserve.engine.observe.kv_publisher import open_kv_events
from kvserve.engine.output.types import PrefixCacheReport, RequestDelta
from kvserve.engine.output.processor import OutputProcessor
from kvserve.engine.output.prefix_report import explain_prompt
from kvserve.engine.request import Request
from kvserve.engine.runner import ModelRunner
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.step_budget import StepBudget
from kvserve.engine.setup import build_engine_parts
from kvserve.engine.observe.snapshots import SnapshotKeeper
from kvserve.engine.spec_decode.factory import build_drafting
from kvserve.engine.spec_decode.slots import DraftSlotLog
from kvserve.engine.observe.stats import EngineStats, StepWork
from kvserve.engine.validation import RequestLimits
from kvserve.errors import InvalidRequestError
from kvserve.kv.prefix.pins import PinRequest
from kvserve.model.loader import LoadedModel

# How long a step with nothing to run but tier reads in flight waits for one to end: short, because adds
# and aborts wait for the step to return.
_IDLE_LOAD_WAIT_S = 0.01


class Engine:
    """Continuous-batching engine over a paged KV cache.

    `add_request` validates and queues; each `step()` runs one batched model
    forward and returns a RequestDelta (what the step added: the accepted
    tokens, text and logprobs) for every request that accepted tokens or
    finished; RequestOutputAssembler builds final outputs from them. Not
    thread-safe: one caller drives it (the server's async engine owns that
    loop); only `stats()` may be called from another thread at any time.

    A request's state lives in the scheduler (progress), the KV manager
    (blocks), the runner (sampling state), the output processor (text, stop
    conditions) and the pending breakpoints; `retire` is the one way out of
    all of them, for a finish, an error and an abort alike.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] | None = None, proposer: Proposer | None = None,
                 num_speculative_tokens: int | None = None) -> None:
        """`clock` (seconds, monotonic) times pin TTLs; tests pass a fake one. Drafting follows
        `config.speculative`; a `proposer` replaces the configured one, drafting up to
        `num_speculative_tokens` (default: the config's) tokens per decoding request per step."""
        parts = build_engine_parts(config or EngineConfig(), loaded, clock)
        self.config, self.loaded, self.max_model_len = parts.config, parts.loaded, parts.max_model_len
        self.kv_spec, self.kv_cache, self.kv_manager = parts.kv_spec, parts.kv_cache, parts.kv_manager
        self.attention_backend, self.tiers, self.tiering, self.prefix_caching = (
            parts.attention_backend, parts.tiers, parts.tiering, parts.prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv_manager, self.max_model_len)
        self.step_budget = StepBudget(self.config.step_target_ms, self.config.max_num_batched_tokens,
                                      self.config.block_size)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, self.attention_backend, parts.device,
                                  tiers=self.tiers, states=parts.state_cache)
        # Without a KV cache, blocks are scratch for one step: a request holds no cache memory.
        page_bytes = self.kv_spec.page_bytes(self.config.block_size) if self.config.enable_kv_cache else 0
        self.outputs = OutputProcessor(self.loaded.tokenizer, self.kv_manager, page_bytes, self.prefix_caching)
        self.breakpoints = PendingBreakpoints(self.kv_manager, self.config.block_size)
        self.limits = RequestLimits(self.config, self.loaded.config.vocab_size, self.max_model_len, self.kv_manager)
        self.constrained = ConstrainedRequests(self.loaded.tokenizer, self.loaded.config.vocab_size,
                                               self.max_model_len, self.config.max_num_batched_tokens)
        self.drafting = build_drafting(self.config, self.max_model_len, proposer, num_speculative_tokens)
        self.compression = RequestCompression(self.config, self.kv_spec)
        # Where each step's drafts went in the cache, for the lab's map (drafting on only).
        self.draft_slots = DraftSlotLog(self.kv_manager) if self.drafting is not None else None
        self.snapshots = SnapshotKeeper(self.scheduler, self.tiering,
                                        self.drafting.counters if self.drafting is not None else None,
                                        self.draft_slots, self.constrained)
        self.kept_tokens = self.runner.kept_tokens = self.snapshots.kept_tokens  # off until the lab enables it
        self._ids = itertools.count()
        # Last: a publisher is a thread and sockets, not to be left behind by a failed start.
        self.kv_events = open_kv_events(self.config, self.kv_manager.pool,
                                        self.tiers.named("disk") if self.tiers is not None else None)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    arrival_time: float | None = None, pins: Sequence[PinRequest] = (),
                    tenant: str | None = None, priority: int = 0) -> str:
        """Queue a request (text or token ids); invalid ones raise InvalidRequestError and change nothing.

        Requests with different `cache_salt` never share cached blocks (the
        server derives it from the caller's identity). `arrival_time`
        (time.perf_counter) is when the request really arrived, if earlier than
        now; TTFT counts from it. `pins` are cache breakpoints in the prompt:
        once the prompt is computed, its whole blocks up to each are pinned
        (or their pin renewed) for the breakpoint's TTL.
        """
        params = params or SamplingParams()
        self.kv_manager.expire_pins()  # also while idle: a new request sweeps what expired meanwhile
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.loaded.require_tokenizer().encode(prompt) if text is not None else list(prompt)
        kv_compression = self.compression.for_request(params)  # may refuse
        self.limits.validate(token_ids, params, self.compression.policy(kv_compression, len(token_ids)))
        check_breakpoints(pins, len(token_ids))
        matcher = self.constrained.new_matcher(params)  # compiles (or finds it cached): may refuse
        self.outputs.add(request_id, params)  # the last check that can refuse: nothing to undo before it
        request = Request(request_id, token_ids, params, prompt=text, cache_salt=cache_salt,
                          block_size=self.config.block_size if self.prefix_caching else None, tenant=tenant,
                          priority=priority, kv_compression=kv_compression)
        request.compression = self.compression.policy(kv_compression, len(token_ids))
        if request.compression is not None:
            self.kv_manager.set_compression(request_id, request.compression)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        self.runner.add_request(request_id, params, token_ids, matcher, kv_compression)
        self.constrained.add(request_id, matcher)
        self.scheduler.add(request)
        if self.prefix_caching:
            self.breakpoints.add(request_id, pins)
        self.snapshots.added(request)
        return request_id

    def set_tenant_weights(self, weights: dict[str | None, float]) -> None:
        """Each tenant's weight (default 1) in the fair share of a step's tokens and of the KV pool."""
        self.scheduler.fair.set_weights(weights)
        self.kv_manager.pool.quota.set_weights(weights)

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if `add_request` would refuse these; safe from any thread. A structured
        outputs spec is compiled here (bounded in time, then cached, so the add finds it ready)."""
        kv_compression = self.compression.for_request(params)
        self.limits.validate(token_ids, params, self.compression.policy(kv_compression, len(token_ids)))
        self.constrained.compile(params)

    def step(self) -> list[RequestDelta]:
        """Run one batched forward. A request that fails in it (its sampling, its post-processing,
        or a forward that also fails when it runs alone) is finished with an error output; every
        other request goes on as if it had not been there."""
        self.kv_manager.expire_pins()
        if self.tiering is not None:  # tier blocks that arrived: copied in, their requests run this step
            self.scheduler.finish_loads(self.tiering.loads_finished(self.runner.complete_loads()))
        self.scheduler.contended_budget = self.step_budget.contended_tokens()
        scheduled = self.scheduler.schedule()
        if scheduled.loads:
            self.runner.start_loads(scheduled.loads)
        if scheduled.empty:
            if self.scheduler.loading:  # nothing to compute until a read ends: wait for it, not a spin
                self.runner.wait_for_loads(_IDLE_LOAD_WAIT_S)
            self.snapshots.take()  # a request may have been preempted or set loading without anything running
            return []
        work = StepWork(scheduled.num_batched_tokens, sum(item.num_computed_tokens for item in scheduled.scheduled))
        started = time.perf_counter()
        result = execute_isolating_failures(self.runner, scheduled)
        self.step_budget.observe(scheduled.num_batched_tokens, time.perf_counter() - started)
        # Failed requests end before any progress is recorded: their blocks of this step may hold
        # garbage and must never be hashed into the prefix cache.
        deltas = [self.retire(self.scheduler.requests[request_id], "error", error=f"{type(exc).__name__}: {exc}")
                  for request_id, exc in result.failures.items()]
        for exc in result.failures.values():
            self.constrained.failed(exc)
        for request_id, (first, entries) in result.prompt_logprobs.items():
            self.scheduler.requests[request_id].record_prompt_logprobs(first, entries)
        num_accepted = 0
        for item in scheduled.scheduled:
            if item.request_id in result.failures:
                continue
            request = self.scheduler.requests[item.request_id]
            accepted = result.tokens.get(item.request_id, [])
            kept, reason = self.outputs.accept(request, accepted) if accepted else ([], None)
            if kept and request.new_logprobs is not None:
                request.new_logprobs.extend(result.logprobs[item.request_id][: len(kept)])
            drafted = bool(item.draft_token_ids) and self.draft_slots is not None
            pending = self.draft_slots.written(item.request_id, item.num_computed_tokens, item.num_new_tokens,
                                               len(item.draft_token_ids)) if drafted else None
            num_accepted_drafts = self.scheduler.advance(item, len(accepted), len(kept))
            if drafted:
                self.draft_slots.settled(pending, len(item.draft_token_ids), num_accepted_drafts,
                                         request.num_computed_tokens)
            if kept and reason is None and (reason := self.constrained.after_step(request)) is not None:
                self.outputs.tracker(request.request_id).finish(reason)  # the grammar is complete
            if item.draft_token_ids and self.drafting is not None:
                self.drafting.observe(request, len(item.draft_token_ids), num_accepted_drafts)
            if not kept:
                continue
            num_accepted += len(kept)
            self.breakpoints.prompt_computed(request)
            deltas.append(self.retire(request, reason, kept) if reason is not None else self.outputs.delta(request, kept))
        if self.tiering is not None:
            self.tiering.write_through()  # before the next step can hand these blocks out again
        if self.drafting is not None:
            self.drafting.propose(self.scheduler.running)
        self.snapshots.record_step(work, num_accepted)
        self.snapshots.take()
        return deltas

    def retire(self, request: Request, reason: str, new_token_ids: Sequence[int] = (),
               error: str | None = None) -> RequestDelta:
        """End a request wherever it is (finished, failed or aborted): its blocks go back to the pool and
        every piece of per-request state is dropped. Returns its final delta."""
        self.scheduler.finish(request, reason)
        self.kv_manager.forget_compression(request.request_id)
        self.kept_tokens.finish(request.request_id)
        if self.drafting is not None:
            self.drafting.finish(request, reason)
        delta = self.outputs.delta(request, list(new_token_ids), error)
        self.outputs.remove(request.request_id)
        self.runner.remove_request(request.request_id)
        self.constrained.remove(request.request_id)
        self.breakpoints.remove(request.request_id)
        return delta

    def abort(self, request_id: str) -> RequestDelta | None:
        """Stop a request wherever it is (waiting, prefilling, decoding); its blocks are freed."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        delta = self.retire(request, "abort")
        self.snapshots.take()
        return delta

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        """Every request added and not yet finished or aborted (call it between steps)."""
        return list(self.scheduler.requests)

    def stats(self) -> EngineStats:
        """The snapshot taken at the end of the last step, add or abort. Safe from any thread, even mid-step."""
        return self.snapshots.current

    def request_block_view(self) -> None:
        """Have the next snapshot carry a fresh BlockView (the lab's block map asks a few times per second
        while someone watches). Call it between steps."""
        self.snapshots.want_block_view(idle=not self.has_unfinished())

    def zero_pool_ahead(self) -> bool:
        """Zero one piece (one layer tensor's slice, milliseconds) of the KV pool past the blocks steps have used,
        so that no later step faults its pages in (kv/cache/zeroing.py): the whole pool, committing it, unless
        it may be larger than memory (`allow_kv_overcommit`: a huge page's worth past the used blocks); whether
        more is left. The server's loop calls it while idle, between steps."""
        return self.kv_cache.zero_ahead(whole_pool=not self.config.allow_kv_overcommit)

    def expire_pins(self) -> int:
        """Drop the pins whose TTL ran out (every step does this too); returns how many. Between steps."""
        expired = self.kv_manager.expire_pins()
        if expired:
            self.snapshots.take()
        return expired

    def explain_prompt(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixCacheReport:
        """The report a request with these tokens would get at admission now, running nothing (the pool
        only: a lower tier is not read). Between steps (the server calls it through AsyncEngine.call)."""
        return explain_prompt(self.kv_manager, token_ids, cache_salt, self.prefix_caching, self.config.block_size,
                              self.loaded.tokenizer)

    @property
    def pool_bytes(self) -> int:
        """Bytes the KV pool was allocated (fixed for the engine's life)."""
        return self.kv_cache.bytes_allocated

    def close(self) -> None:
        """Finish background work (tier reads, the disk tier's queued writes, the KV events). Not used after."""
        self.runner.close()
        if self.tiering is not None:
            self.tiering.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def check_integrity(self) -> None:
        """Block accounting holds (DESIGN §4), in the pool and in a lower tier; raises KVIntegrityError."""
        check_engine_integrity(self.scheduler, self.tiers, self.runner.loads_in_flight())
