"""One snapshot of the engine's state, taken between steps, for readers on other threads.

Metrics, `/v1/kv_cache`, the async engine (and later the lab) read this
instead of reaching into the scheduler or the KV manager. The engine builds a
new snapshot at the end of every step, add and abort (O(requests), no tensor
work) and swaps it in with one attribute assignment; a reader holding the
previous one keeps a consistent, immutable view while the next step runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from kvserve.engine.observe.compression_stats import CompressionStats, compression_stats
from kvserve.engine.observe.tenant_stats import TenantStats, tenant_stats
from kvserve.engine.sample.constrained import StructuredOutputStats
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.spec_decode.slots import StepDrafts
from kvserve.engine.spec_decode.counters import SpecDecodeStats
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix.pins import PinStats
from kvserve.kv.state.manager import StateStats
from kvserve.kv.tiers.stats import TierStats


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One unfinished request as of the snapshot."""

    request_id: str
    status: str  # "waiting", "loading" (its prefix from a lower tier), "preempted" (waiting again), "prefilling" or "decoding"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission (0 before)
    num_tier_cached_tokens: int  # of those, loaded from a lower tier (disk)
    num_computed_tokens: int  # tokens whose K/V are in the cache now
    num_output_tokens: int
    num_blocks: int  # KV blocks it holds now
    num_preemptions: int
    ttft: float | None  # seconds, once the first token is out
    tpot: float | None  # mean seconds per output token after the first, so far
    num_dropped_tokens: int = 0  # prompt tokens KV compression took out of its tables now (its blocks exclude them)


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computed: the new tokens whose K/V it computed, and the cached tokens their
    attention read instead of recomputing (the lab's cached-vs-recomputed page shows both)."""

    num_tokens: int = 0
    num_reused_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BlockView:
    """Every block of the pool after one step, for the lab's block map.

    O(blocks) to build, so the engine builds one only when a reader asked for it
    (Engine.request_block_view) and otherwise carries the last one forward:
    `num_steps` says which step it shows.
    """

    num_steps: int
    ref_counts: tuple[int, ...]  # by block id
    hashed: tuple[bool, ...]  # by block id: holds a reusable prefix (in use or free)
    tables: tuple[tuple[str, tuple[int, ...]], ...]  # (request id, its block ids)
    drafts: StepDrafts | None = None  # the draft slots step `num_steps` wrote and rolled back (None: drafting off)
    states: StateStats | None = None  # a hybrid model's state slots after the same step (drawn beside the blocks)

    def state_counts(self) -> dict[str, int]:
        """Blocks per state: free, cached (free but still holding a prefix), used (one holder), shared (several)."""
        counts = {"free": 0, "cached": 0, "used": 0, "shared": 0}
        for ref_count, hashed in zip(self.ref_counts, self.hashed):
            state = "shared" if ref_count > 1 else "used" if ref_count else "cached" if hashed else "free"
            counts[state] += 1
        return counts


def take_block_view(kv: KVCacheManager, num_steps: int, drafts: StepDrafts | None = None) -> BlockView:
    ref_counts, hashed, tables = kv.block_states()
    return BlockView(num_steps, tuple(ref_counts), tuple(hashed),
                     tuple((request_id, tuple(ids)) for request_id, ids in tables.items()), drafts, kv.state_stats())


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine between two steps: pool usage, counters, and every unfinished request."""

    taken_at: float  # time.perf_counter() when taken
    block_size: int
    num_blocks: int
    num_used_blocks: int  # held by requests
    num_free_blocks: int  # includes the cached-but-free ones
    num_cached_blocks: int  # holding a reusable prefix, in use or free
    num_cached_free_blocks: int  # free, but still holding a reusable prefix until handed out again
    prefix_cache_queries: int  # prompt tokens looked up (monotonic)
    prefix_cache_hits: int  # prompt tokens served from the cache (monotonic)
    num_preemptions: int  # monotonic
    num_steps: int  # steps that ran a batch (monotonic)
    num_generated_tokens: int  # output tokens sampled (monotonic)
    running: tuple[RequestStats, ...]  # admission order
    waiting: tuple[RequestStats, ...]  # those loading from a lower tier, then the queue in order
    tier: TierStats | None = None  # the lower KV tier (disk), if there is one
    pins: PinStats | None = None  # pinned prefixes (cache breakpoints with a TTL)
    num_context_shifts: int = 0  # monotonic: sequences shifted past the context (--context-overflow shift)
    num_compressed_tokens: int = 0  # monotonic: prompt tokens KV compression dropped from the pool (issue 43)
    last_step: StepWork = StepWork()  # what the last step that ran a batch computed
    blocks: BlockView | None = None  # the pool block by block, as of blocks.num_steps (only once asked for)
    spec_decode: SpecDecodeStats | None = None  # drafts and acceptances (None: speculative decoding off)
    draft_slots: StepDrafts | None = None  # the last step's draft slots in the cache (None: drafting off)
    structured: StructuredOutputStats | None = None  # grammars compiled, constrained requests, forced tokens
    tenants: tuple[TenantStats, ...] = ()  # per-tenant usage (engine/observe/tenant_stats.py)
    states: StateStats | None = None  # a hybrid model's recurrent-state slots (None: no recurrent layers)
    compression: CompressionStats | None = None  # compressing requests' blocks and dropped tokens (None: none ran)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks held by requests (1 = full)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def requests(self) -> tuple[RequestStats, ...]:
        return self.running + self.waiting

    def request(self, request_id: str) -> RequestStats | None:
        return next((r for r in self.requests if r.request_id == request_id), None)


def request_stats(request: Request, kv: KVCacheManager) -> RequestStats:
    if request.status is RequestStatus.RUNNING:
        status = "decoding" if request.is_decoding else "prefilling"
    else:
        status = "preempted" if request.num_preemptions else request.status.value
    metrics = request.metrics
    return RequestStats(
        request.request_id, status, request.num_prompt_tokens, request.num_cached_tokens or 0,
        request.num_tier_cached_tokens, request.num_computed_tokens, metrics.num_output_tokens, kv.num_blocks_held(request.request_id),
        request.num_preemptions, metrics.ttft, metrics.tpot, kv.dropped_tokens(request.request_id),
    )


def take_stats(scheduler: Scheduler, num_steps: int, num_generated_tokens: int, last_step: StepWork = StepWork(),
               blocks: BlockView | None = None, tier: TierStats | None = None,
               pins: PinStats | None = None, spec_decode: SpecDecodeStats | None = None,
               draft_slots: StepDrafts | None = None, structured: StructuredOutputStats | None = None
               ) -> EngineStats:
    """A snapshot of the pool and of every unfinished request. Call it between steps, on the engine's thread."""
    kv = scheduler.kv
    num_free = kv.num_free_blocks
    return EngineStats(
        taken_at=time.perf_counter(), block_size=kv.block_size, num_blocks=kv.num_blocks,
        num_used_blocks=kv.num_blocks - num_free, num_free_blocks=num_free, num_cached_blocks=kv.num_cached_blocks,
        num_cached_free_blocks=kv.num_cached_free_blocks, prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits, num_preemptions=scheduler.num_preemptions,
        num_context_shifts=scheduler.num_context_shifts, num_compressed_tokens=kv.compressed.num_dropped_tokens,
        num_steps=num_steps, num_generated_tokens=num_generated_tokens,
        running=tuple(request_stats(r, kv) for r in scheduler.running),
        waiting=tuple(request_stats(r, kv) for r in [*(r for r, _ in scheduler.loading.values()), *scheduler.waiting]),
        last_step=last_step, blocks=blocks,
        tier=tier, pins=pins, spec_decode=spec_decode, draft_slots=draft_slots, structured=structured,
        tenants=tenant_stats(scheduler), states=kv.state_stats(),
        compression=compression_stats(scheduler.running, kv) if kv.compressed.policies or
        kv.compressed.num_dropped_tokens else None,
    )


def with_added(stats: EngineStats, request: Request, kv: KVCacheManager) -> EngineStats:
    """`stats` plus a newly queued request (at the back of the queue): an add changes nothing else,
    and copying the snapshot's tuples is cheaper than rebuilding every entry when thousands are queued."""
    return replace(stats, taken_at=time.perf_counter(), waiting=stats.waiting + (request_stats(request, kv),))
