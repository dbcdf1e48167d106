"""The step loop: add requests, step (schedule -> run -> update), abort."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from kvserve.config import EngineConfig
from kvserve.engine.config_checks import check_kv_budget, checked_max_model_len
from kvserve.engine.output import OutputTracker, PrefixCacheReport, RequestDelta
from kvserve.engine.prefix_report import build_prefix_report
from kvserve.engine.request import Request
from kvserve.engine.runner import ModelRunner, StepResult
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.stats import BlockView, EngineStats, StepWork, take_block_view, take_stats, with_added
from kvserve.engine.tiering import TierTraffic, open_disk_tier
from kvserve.errors import ConfigError, InvalidRequestError, KVIntegrityError
from kvserve.kv.attention import get_attention_backend
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import PinRequest, cache_write_tokens
from kvserve.kv.spec import kv_spec
from kvserve.model.loader import LoadedModel, load_model
from kvserve.platform import keep_freed_memory

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over a paged KV cache.

    `add_request` validates and queues; each `step()` runs one batched model
    forward and returns a RequestDelta (what the step added: the new token,
    text and logprobs) for every request that produced a token or finished;
    RequestOutputAssembler builds final outputs from them. Not thread-safe: one
    caller drives it (the server's async engine owns that loop); only
    `stats()` may be called from another thread at any time.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """`clock` (seconds, monotonic) times pin TTLs; tests pass a fake one."""
        self.config = config = config or EngineConfig()
        check_kv_budget(config)  # before the load: an impossible budget fails in a second
        keep_freed_memory()
        self.attention_backend = get_attention_backend(config.attention_backend)  # fails before the model loads
        self.loaded = loaded or load_model(config.model, config.kv_cache_dtype, config.weights_dtype)
        model_config = self.loaded.config
        self.max_model_len = checked_max_model_len(config, model_config)
        self.kv_spec = kv_spec(model_config, config.kv_cache_dtype, self.loaded.linear_dtype)
        layout = self.kv_spec.layout
        # One block of the pool is one KV group's page: block_size tokens of page_layers layers.
        block_bytes = self.kv_spec.page_bytes(config.block_size)
        budget = config.kv_cache_bytes  # the default is a share of what is free after the load
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory of {budget:,} bytes holds no block of {block_bytes:,} bytes "
                              f"({config.block_size} tokens x {layout.page_layers} layers x "
                              f"{self.kv_spec.bytes_per_token_per_layer:,} bytes/token/layer)")
        if config.kv_disk_path is not None and layout.has_windows:
            raise ConfigError("kv_disk_path: the disk tier holds prefix blocks of full-attention models only; "
                              "this model has sliding-window layers (their blocks are freed behind the window)")
        self.kv_cache = self.attention_backend.allocate_kv_cache(self.kv_spec, num_blocks, config.block_size)
        # Without a KV cache there is nothing to share: a hit would skip the recompute.
        self.prefix_caching = config.enable_prefix_caching and config.enable_kv_cache
        self.tiering: TierTraffic | None = None
        tier = (open_disk_tier(config, self.loaded, self.kv_cache, self.kv_spec.dtype)
                if config.kv_disk_path is not None else None)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, enable_caching=self.prefix_caching,
                                         record_cached_blocks=tier is not None,
                                         max_pinned_fraction=config.max_pinned_fraction, clock=clock,
                                         group_windows=layout.windows)
        # Breakpoints of requests whose prompt is not computed yet: pinned once it is (kv/pins.py).
        self._pending_pins: dict[str, tuple[PinRequest, ...]] = {}
        if tier is not None:
            self.tiering = TierTraffic(tier, self.kv_manager, self.kv_cache)
        if config.context_overflow == "shift":
            if layout.has_windows:
                raise ConfigError("context_overflow='shift' re-rotates full-attention caches; this model has "
                                  "sliding-window layers, whose windows already bound what they hold")
            if config.keep_tokens > self.max_model_len // 2:
                raise ConfigError(f"keep_tokens ({config.keep_tokens}) must be at most half the context "
                                  f"({self.max_model_len} tokens): a shift drops half of what is not kept")
        self.scheduler = Scheduler(config, self.kv_manager, self.max_model_len)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, self.attention_backend)
        self._ids = itertools.count()
        self._num_steps = self._num_generated_tokens = 0
        self._last_step = StepWork()
        self._block_view: BlockView | None = None  # the last one built, carried into later snapshots
        self._block_view_wanted = self._block_view_current = False
        self._stats = self._take_stats()
        if layout.num_groups == 1:
            geometry = (f"{num_blocks} blocks x {config.block_size} tokens = {num_blocks * config.block_size} tokens, "
                        f"{self.kv_spec.bytes_per_token:,} bytes/token ({self.kv_spec.dtype})")
            groups = ","
        else:  # a block is one group's page
            geometry = (f"{num_blocks} blocks of {config.block_size} tokens x {layout.page_layers} layers "
                        f"({block_bytes:,} bytes each, {self.kv_spec.dtype})")
            groups = f"; KV groups: {layout.describe()};"
        if layout.has_windows:
            groups += " blocks behind a window are freed;"
        log.info("KV cache: %s, %.1f MiB%s prefix caching %s%s", geometry, self.kv_cache.bytes_allocated / 2**20,
                 groups, "on" if self.prefix_caching else "off",
                 "" if config.enable_kv_cache else "; KV cache DISABLED: every step recomputes every sequence")
        if self.kv_spec.k_codec.is_fp8 or self.kv_spec.v_codec.is_fp8:
            log.warning("%s KV cache: this CPU has no fp8 arithmetic, so every read converts the gathered blocks "
                        "to float32 in software (works; int8 is as small and faster here)", self.kv_spec.dtype)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        pins: Sequence[PinRequest] = (),
    ) -> str:
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
        self.validate_request(token_ids, params)
        tracker = OutputTracker(params, self.loaded.tokenizer)
        request = Request(request_id, token_ids, params, tracker, prompt=text, cache_salt=cache_salt,
                          block_size=self.config.block_size if self.prefix_caching else None)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        bad_pin = next((p for p in pins if not 0 < p.num_tokens <= len(token_ids) or p.ttl_s <= 0), None)
        if bad_pin is not None:
            raise InvalidRequestError(f"a cache breakpoint must lie in the prompt ({len(token_ids)} tokens) and "
                                      f"have a positive TTL, got {bad_pin}")
        self.runner.add_request(request_id, params, token_ids)
        self.scheduler.add(request)
        if pins and self.prefix_caching:
            self._pending_pins[request_id] = tuple(pins)
        self._stats = with_added(self._stats, request, self.kv_manager)
        return request_id

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if `add_request` would refuse these. Reads only fixed
        limits, so it is safe to call from any thread while a step runs."""
        vocab = self.loaded.config.vocab_size
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if self.config.context_overflow == "shift":
            # Generation continues past the context by dropping old tokens: only the prompt must fit.
            if len(token_ids) > self.max_model_len:
                raise InvalidRequestError(f"the prompt ({len(token_ids)} tokens) exceeds the model's context of "
                                          f"{self.max_model_len} tokens (context shift applies to generation)")
            total = min(total, self.max_model_len)
        elif total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        chunk = self.config.max_num_batched_tokens
        if not self.kv_manager.can_fit(total, chunk):
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{self.kv_manager.peak_blocks(total, chunk)} KV blocks but the whole cache has "
                f"{self.kv_manager.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (monotonic)."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens served from the prefix cache (monotonic)."""
        return self.scheduler.prefix_cache_hits

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        """Every request added and not yet finished or aborted (call it between steps)."""
        return list(self.scheduler.requests)

    def stats(self) -> EngineStats:
        """The snapshot taken at the end of the last step, add or abort. Safe from any thread, even mid-step."""
        return self._stats

    def request_block_view(self) -> None:
        """Have the next snapshot carry a fresh BlockView (O(blocks), so built only when asked: the lab's
        feed asks a few times per second while someone watches). Call it between steps. An idle engine
        takes the snapshot at once, since no step will come to take it; if nothing changed since its last
        view, that one stays (readers can tell by identity that nothing is new)."""
        if self.has_unfinished():
            self._block_view_wanted = True
        elif not self._block_view_current:  # idle, and the pool changed since the last view
            self._block_view_wanted = True
            self._stats = self._take_stats()

    def _take_stats(self) -> EngineStats:
        # Every snapshot but an add's follows a change of the pool (a step, an abort): the view is
        # current only if it was built in this one.
        self._block_view_current = self._block_view_wanted
        if self._block_view_wanted:
            self._block_view_wanted = False
            self._block_view = take_block_view(self.kv_manager, self._num_steps)
        tier = self.tiering.stats() if self.tiering is not None else None
        return take_stats(self.scheduler, self._num_steps, self._num_generated_tokens, self._last_step,
                          self._block_view, tier, pins=self.kv_manager.pin_stats())

    def expire_pins(self) -> int:
        """Drop the pins whose TTL ran out (every step does this too); returns how many. Between steps."""
        expired = self.kv_manager.expire_pins()
        if expired:
            self._stats = self._take_stats()
        return expired

    def _pin_breakpoints(self, request: Request) -> None:
        """A request's prompt is computed (it sampled a token): pin its breakpoints, and count the
        tokens it wrote to the cache at the last one."""
        pins = self._pending_pins.pop(request.request_id, None)
        if not pins:
            return
        for pin in pins:
            self.kv_manager.pin(request.block_hashes, pin.num_tokens, pin.ttl_s)
        last = max(pin.num_tokens for pin in pins)
        self.kv_manager.record_cache_write(cache_write_tokens(last, request.num_cached_tokens or 0,
                                                              self.config.block_size))

    def step(self) -> list[RequestDelta]:
        """Run one batched forward. A request that fails in it (its sampling, its post-processing,
        or a forward that also fails when it runs alone) is finished with an error output; every
        other request goes on as if it had not been there."""
        self.kv_manager.expire_pins()
        if self.tiering is not None:
            self.tiering.load_for(self.scheduler.admission_candidates())
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            self._stats = self._take_stats()  # a request may have been preempted without anything running
            return []
        self._last_step = StepWork(scheduled.num_batched_tokens,
                                   sum(item.num_computed_tokens for item in scheduled.scheduled))
        try:
            result = self.runner.execute(scheduled)
        except Exception as exc:
            result = self._execute_one_by_one(scheduled, exc)
        outputs = self._fail_requests(scheduled, result.failures)
        self._record_logprobs(result)
        touched = self.scheduler.update(scheduled, result.tokens)
        if self.tiering is not None:
            self.tiering.write_through()  # before the next step can hand these blocks out again
        for request in touched:
            if request.request_id in self._pending_pins:
                self._pin_breakpoints(request)
        self._num_steps += 1
        self._num_generated_tokens += len(touched)
        self._stats = self._take_stats()
        for request in touched:
            outputs.append(self._output(request, [request.all_token_ids[-1]]))
            if request.finished:
                self.runner.remove_request(request.request_id)
        return outputs

    def _execute_one_by_one(self, scheduled: SchedulerOutput, batch_error: Exception) -> StepResult:
        """The batch forward raised: run each request alone to find the culprit(s).

        Re-running is safe: a failed step advanced no request, and its K/V
        writes land in the same slots again. Only the requests that fail alone
        fail; if every one does (a broken model), every one fails.
        """
        if len(scheduled.scheduled) == 1:
            return StepResult(failures={scheduled.scheduled[0].request_id: batch_error})
        log.warning("a batched step of %d requests failed (%s: %s); retrying them one by one to find the culprit",
                    len(scheduled.scheduled), type(batch_error).__name__, batch_error)
        merged = StepResult()
        for item in scheduled.scheduled:
            try:
                merged.merge(self.runner.execute(SchedulerOutput(scheduled=[item])))
            except Exception as exc:
                merged.failures[item.request_id] = exc
        return merged

    def _fail_requests(self, scheduled: SchedulerOutput, failures: dict[str, Exception]) -> list[RequestDelta]:
        """Finish failed requests before the step's progress is recorded: their blocks of this step
        may hold garbage and must never be hashed into the prefix cache."""
        if not failures:
            return []
        scheduled.scheduled = [item for item in scheduled.scheduled if item.request_id not in failures]
        outputs = []
        for request_id, exc in failures.items():
            log.error("request %s failed and was finished alone: %s: %s", request_id, type(exc).__name__, exc,
                      exc_info=exc)
            request = self.scheduler.requests[request_id]
            self._pending_pins.pop(request_id, None)
            self.scheduler.finish(request, "error")
            self.runner.remove_request(request_id)
            output = self._output(request, [])
            output.error = f"{type(exc).__name__}: {exc}"
            outputs.append(output)
        return outputs

    def _record_logprobs(self, result: StepResult) -> None:
        for request_id, logprob in result.logprobs.items():
            self.scheduler.requests[request_id].new_logprobs.append(logprob)
        for request_id, (first, logprobs) in result.prompt_logprobs.items():
            self.scheduler.requests[request_id].record_prompt_logprobs(first, logprobs)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Stop a request wherever it is (waiting, prefilling, decoding); its blocks are freed."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self._pending_pins.pop(request_id, None)
        self.scheduler.finish(request, "abort")
        self.runner.remove_request(request_id)
        self._stats = self._take_stats()
        return self._output(request, [])

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestDelta:
        """What this step added to `request`: O(1) in its length (nothing cumulative is copied)."""
        new_logprobs, new_prompt_logprobs = request.take_new_logprobs()
        return RequestDelta(
            request.request_id, request.prompt, request.prompt_token_ids, new_token_ids,
            request.tracker.take_delta(), request.finish_reason, request.finished, request.metrics,
            num_cached_tokens=request.num_cached_tokens or 0, kv_cache_bytes=self._held_bytes(request),
            prefix_cache=self._prefix_report(request), new_logprobs=new_logprobs,
            new_prompt_logprobs=new_prompt_logprobs,
        )

    def _prefix_report(self, request: Request) -> PrefixCacheReport | None:
        if request.num_cached_tokens is None:
            return None  # not admitted yet
        if request.prefix_cache_report is None:  # once per request, not on every step's output
            request.prefix_cache_report = build_prefix_report(request, self.prefix_caching, self.config.block_size,
                                                              self.loaded.tokenizer)
        return request.prefix_cache_report

    def explain_prompt(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixCacheReport:
        """How the prefix cache would serve this prompt now, and where it would leave the closest cached
        prompt: the report a request gets at admission, without running anything. Read-only; call it
        between steps (the server does, through AsyncEngine.call). The pool only: blocks a lower tier
        could supply are not looked up (that would read them)."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        params = SamplingParams(max_tokens=1)
        request = Request("explain", token_ids, params, OutputTracker(params, None), cache_salt=cache_salt,
                          block_size=self.config.block_size if self.prefix_caching else None)
        match = self.kv_manager.find_cached_prefix(request.all_token_ids, request.block_hashes)
        request.num_cached_tokens = match.num_tokens
        if match.num_tokens < request.num_prompt_tokens - 1:  # as the scheduler does at admission
            request.prefix_divergence = self.kv_manager.find_divergence(request.all_token_ids, match)
        return build_prefix_report(request, self.prefix_caching, self.config.block_size, self.loaded.tokenizer)

    def _held_bytes(self, request: Request) -> int:
        """KV memory the request holds now (when finished: what it held when it finished)."""
        if not self.config.enable_kv_cache:  # blocks were scratch for one step, not a cache
            return 0
        blocks = request.kv_blocks_held if request.finished else self.kv_manager.num_blocks_held(request.request_id)
        return blocks * self.kv_spec.page_bytes(self.config.block_size)

    def persistent_directory(self) -> Path | None:
        """Where state tied to this model and cache layout may outlive the process: the disk tier's
        fingerprinted directory (None without a disk tier, or once it disabled itself)."""
        if self.tiering is None:
            return None
        stats = self.tiering.stats()
        return Path(stats.location) if stats.enabled else None

    def close(self) -> None:
        """Finish background work (the disk tier's queued writes). The engine is not used after."""
        if self.tiering is not None:
            self.tiering.close()

    def check_integrity(self) -> None:
        """Block accounting holds (DESIGN §4), in the pool and in a lower tier (what it holds and what is
        in flight to it); raises KVIntegrityError otherwise."""
        self.kv_manager.check_integrity()
        if self.tiering is not None:
            self.tiering.tier.check_integrity()
        for request in self.scheduler.running:
            self.kv_manager.check_tables(request.request_id, request.num_computed_tokens)
        for request in self.scheduler.waiting:
            if self.kv_manager.num_blocks_held(request.request_id):
                raise KVIntegrityError(f"waiting request {request.request_id} holds blocks")
        if not self.has_unfinished() and self.kv_manager.num_free_blocks != self.kv_manager.num_blocks:
            raise KVIntegrityError(f"blocks leaked: {self.kv_manager.num_used_blocks} of {self.kv_manager.num_blocks} "
                                   f"are held with no request unfinished")

