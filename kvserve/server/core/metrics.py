"""Prometheus metrics, named after vLLM's (`vllm:` -> `kvserve:`).

Engine state (requests running / waiting, KV blocks, prefix-cache and
preemption counters) is read when scraped from the engine's stats snapshot
(taken after the last step); latencies and token counts are observed from
each RequestDelta as the step loop emits it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.sample.constrained import StructuredOutputStats
from kvserve.engine.output.types import RequestDelta
from kvserve.engine.spec_decode.counters import SpecDecodeStats
from kvserve.kv.state.manager import StateStats
from kvserve.kv.tiers.stats import LOAD_SECONDS_BUCKETS

log = logging.getLogger("kvserve.requests")

# Seconds; the finer end matters for TPOT on small models, the coarse end for long prompts on CPU.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, tenant_labels: dict | None = None) -> None:
        self.async_engine = async_engine
        self.model_name = model_name
        self.tenant_labels = tenant_labels or {}  # tenant id -> its label (1-based --api-key order)

    def collect(self):
        stats = self.async_engine.engine.stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        used, total = stats.num_used_blocks, stats.num_blocks
        yield gauge("kvserve:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("kvserve:num_requests_waiting", "Requests accepted and waiting to be scheduled.",
                    self.async_engine.num_waiting)
        yield gauge("kvserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", used / total)
        yield gauge("kvserve:kv_cache_blocks_used", "KV-cache blocks held by requests.", used)
        yield gauge("kvserve:kv_cache_blocks_total", "KV-cache blocks in the pool.", total)
        yield gauge("kvserve:kv_cache_blocks_cached", "Blocks holding a reusable prefix (in use or free).",
                    stats.num_cached_blocks)
        yield gauge("kvserve:kv_cache_block_size", "Tokens per KV-cache block.", stats.block_size)
        yield counter("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("kvserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("kvserve:num_preemptions", "Requests preempted to free KV blocks.",
                      stats.num_preemptions)
        yield counter("kvserve:num_context_shifts", "Sequences shifted past the context (oldest tokens dropped).",
                      stats.num_context_shifts)
        yield from _spec_decode_metrics(stats.spec_decode, labels)
        yield from _structured_metrics(stats.structured, labels)
        yield from _tenant_metrics(stats.tenants, self.model_name, self.tenant_labels)
        yield from _state_metrics(stats.states, labels)
        pins = stats.pins
        if pins is not None:
            yield gauge("kvserve:kv_pins", "Live pinned prefixes (cache breakpoints with a TTL).", pins.num_pins)
            yield gauge("kvserve:kv_pinned_blocks", "KV-cache blocks covered by pins (evicted last).",
                        pins.num_pinned_blocks)
            yield gauge("kvserve:kv_pinned_blocks_max", "Most blocks pins may hold (--max-pinned-fraction).",
                        pins.max_pinned_blocks)
            yield counter("kvserve:kv_pins_created", "Pins created.", pins.pins_created)
            yield counter("kvserve:kv_pins_refreshed", "Pins renewed by a breakpoint or a prefix hit.",
                          pins.pins_refreshed)
            yield counter("kvserve:kv_pins_expired", "Pins whose TTL ran out.", pins.pins_expired)
            yield counter("kvserve:kv_pins_lapsed", "Pins dropped early: over the cap, or their blocks were "
                                                    "needed by a request.", pins.pins_lapsed)
            yield counter("kvserve:cache_write_tokens", "Prompt tokens written to the cache at breakpoints.",
                          pins.cache_write_tokens)
        tier = stats.tier
        if tier is None:
            return
        yield gauge("kvserve:kv_tier_enabled", "1 while the disk tier works (0 once it disabled itself).",
                    int(tier.enabled))
        yield gauge("kvserve:kv_tier_capacity_bytes", "Capacity of the disk tier.", tier.capacity_bytes)
        yield gauge("kvserve:kv_tier_used_bytes", "Bytes the disk tier holds.", tier.bytes_used)
        yield gauge("kvserve:kv_tier_blocks", "Blocks the disk tier holds.", tier.num_blocks)
        yield gauge("kvserve:kv_tier_pending_writes", "Blocks queued for the disk tier's writer.", tier.pending_writes)
        for name, doc, value in (
            ("queries_tokens", "Prompt tokens looked up in the disk tier (past the pool's match).", tier.query_tokens),
            ("hits_tokens", "Prompt tokens loaded from the disk tier into the pool.", tier.hit_tokens),
            ("blocks_written", "Blocks written to the disk tier.", tier.blocks_written),
            ("bytes_written", "Bytes written to the disk tier.", tier.bytes_written),
            ("blocks_read", "Blocks read from the disk tier.", tier.blocks_read),
            ("bytes_read", "Bytes read from the disk tier.", tier.bytes_read),
            ("blocks_evicted", "Blocks dropped from the disk tier for capacity.", tier.blocks_evicted),
            ("bytes_evicted", "Bytes dropped from the disk tier for capacity.", tier.bytes_evicted),
            ("writes_dropped", "Blocks not written (writer behind, or tier disabled).", tier.writes_dropped),
            ("files_rejected", "Truncated, corrupted or foreign files skipped and removed.", tier.files_rejected),
        ):
            yield counter(f"kvserve:kv_tier_{name}", doc, value)
        histogram = HistogramMetricFamily("kvserve:kv_tier_load_seconds",
                                          "Time to load one request's run of blocks from the disk tier.",
                                          labels=["model_name"])
        buckets = [(str(bound), count) for bound, count in zip(LOAD_SECONDS_BUCKETS, tier.load_seconds_buckets)]
        histogram.add_metric(labels, buckets + [("+Inf", tier.load_seconds_count)], tier.load_seconds_sum)
        yield histogram


def _tenant_metrics(tenants, model_name: str, tenant_labels: dict):
    """Per-tenant usage, labelled by tenant number (--api-key order; never the key). /metrics is the
    operator's (--metrics-key or the admin key); a tenant sees its own entry in /v1/kv_cache."""
    if not tenant_labels:
        return
    for name, doc, field in (
        ("tenant_requests_running", "A tenant's requests in the running batch.", "num_running"),
        ("tenant_requests_waiting", "A tenant's requests waiting to be scheduled.", "num_waiting"),
        ("tenant_kv_cache_blocks", "KV blocks a tenant owns: held by its requests or holding its prefixes.",
         "num_blocks"),
        ("tenant_kv_cache_share_blocks", "A tenant's fair share of the KV pool, in blocks.", "share_blocks"),
    ):
        family = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["model_name", "tenant"])
        for entry in tenants:
            family.add_metric([model_name, tenant_labels.get(entry.tenant, "anonymous")], getattr(entry, field))
        yield family
    family = CounterMetricFamily("kvserve:tenant_scheduled_tokens", "Tokens a tenant's requests were given in steps.",
                                 labels=["model_name", "tenant"])
    for entry in tenants:
        family.add_metric([model_name, tenant_labels.get(entry.tenant, "anonymous")], entry.num_scheduled_tokens)
    yield family


STATE_SLOT_KINDS = ("live", "snapshot", "working", "free")  # StateStats.slot_kinds' values


def _state_metrics(states: StateStats | None, labels: list[str]):
    """A hybrid model's recurrent-state slots (none for other models): by kind, their size, and the snapshots
    given up for a slot, the state kind's evictions."""
    if states is None:
        return
    family = GaugeMetricFamily("kvserve:state_slots", "Recurrent-state slots by kind: live (a running request's "
                               "state), snapshot (kept for prefix hits), working (read or written by a step), "
                               "free.", labels=["model_name", "kind"])
    counts = Tally(states.slot_kinds)
    for kind in STATE_SLOT_KINDS:
        family.add_metric([*labels, kind], counts[kind])
    yield family
    for name, doc, value in (
        ("state_slots_total", "Recurrent-state slots in the pool (one request's state each).", states.num_slots),
        ("state_slot_bytes", "Bytes of one recurrent-state slot (every recurrent layer's state, float32).",
         states.slot_bytes),
    ):
        gauge = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
        gauge.add_metric(labels, value)
        yield gauge
    evicted = CounterMetricFamily("kvserve:state_snapshots_evicted", "Recurrent-state snapshots given up for a slot.",
                                  labels=["model_name"])
    evicted.add_metric(labels, states.num_evicted)
    yield evicted


def _spec_decode_metrics(spec: SpecDecodeStats | None, labels: list[str]):
    """vLLM's spec-decode counters, and how many draft tokens each verify accepted as a histogram."""
    if spec is None:
        return
    for name, doc, value in (
        ("num_drafts", "Verifies that carried draft tokens.", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
    ):
        family = CounterMetricFamily(f"kvserve:spec_decode_{name}", doc, labels=["model_name"])
        family.add_metric(labels, value)
        yield family
    histogram = HistogramMetricFamily("kvserve:spec_decode_acceptance_length",
                                      "Draft tokens accepted per verify.", labels=["model_name"])
    cumulative = list(itertools.accumulate(spec.acceptance_lengths))
    buckets = [(str(float(length)), count) for length, count in enumerate(cumulative)]
    histogram.add_metric(labels, buckets + [("+Inf", spec.num_drafts)], spec.num_accepted_tokens)
    yield histogram


def _structured_metrics(structured: StructuredOutputStats | None, labels: list[str]):
    """Structured outputs and tool calls, engine side: grammars compiled and refused, requests, forced tokens."""
    if structured is None:
        return
    for name, doc, value in (
        ("grammar_compiles", "Structured-output specs compiled (cache misses), refused or not.",
         structured.grammar_compiles),
        ("grammar_compile_cache_hits", "Structured-output specs found compiled (or refused) already.",
         structured.compile_cache_hits),
        ("grammar_compile_seconds", "Seconds spent compiling (and probing) grammars.", structured.compile_seconds),
        ("grammar_errors", "Specs refused as not compiling, and requests whose grammar failed while running.",
         structured.grammar_errors),
        ("constrained_requests", "Requests run under a grammar (structured output, tool calls, tool_choice none).",
         structured.constrained_requests),
        ("forced_tokens", "Tokens a grammar fixed, appended without sampling.", structured.forced_tokens),
    ):
        family = CounterMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
        family.add_metric(labels, value)
        yield family


class ServerMetrics:
    """The server's registry. `observe` is an AsyncEngine observer."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, tenant_labels: dict | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        histogram = dict(labelnames=labels, registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Time to first token.", **histogram)
        self.itl = Histogram("kvserve:inter_token_latency_seconds", "Time between consecutive output tokens (TPOT).",
                             **histogram)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to finish.", **histogram)
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry)
        self.request_success = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.tool_calls = Counter("kvserve:tool_calls_parsed", "Tool calls parsed out of outputs (any API).", labels,
                                  registry=self.registry)
        self.registry.register(_EngineCollector(async_engine, model_name, tenant_labels))
        self._last_token_time: dict[str, float] = {}

    def observe(self, delta: RequestDelta) -> None:
        metrics = delta.metrics
        request_id = delta.request_id
        new_tokens = len(delta.new_token_ids)
        if new_tokens:
            self.generation_tokens.labels(self.model_name).inc(new_tokens)
            previous = self._last_token_time.get(request_id)
            if previous is None:
                self.ttft.labels(self.model_name).observe(metrics.ttft)
            else:
                self.itl.labels(self.model_name).observe(metrics.last_token_time - previous)
            self._last_token_time[request_id] = metrics.last_token_time
        if delta.finished:
            self._last_token_time.pop(request_id, None)
            reason = delta.finish_reason or "abort"
            self.request_success.labels(self.model_name, reason).inc()
            self.prompt_tokens.labels(self.model_name).inc(metrics.num_prompt_tokens)
            end = metrics.last_token_time if reason != "abort" and metrics.last_token_time else time.perf_counter()
            self.e2e.labels(self.model_name).observe(end - metrics.arrival_time)

    def count_tool_calls(self, num_calls: int) -> None:
        """An API answered with `num_calls` calls (its format calls this once per finished output)."""
        if num_calls:
            self.tool_calls.labels(self.model_name).inc(num_calls)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def log_request(delta: RequestDelta) -> None:
    """One line per finished request: counts and latencies, never the prompt text."""
    if not delta.finished:
        return
    m = delta.metrics
    ttft = f"{m.ttft * 1000:.0f} ms" if m.ttft is not None else "n/a"
    tpot = f"{m.tpot * 1000:.1f} ms" if m.tpot is not None else "n/a"
    report = delta.prefix_cache
    sources = f": {report.sources}" if report is not None and report.sources else ""
    drafts = (f", drafts {m.num_accepted_draft_tokens}/{m.num_draft_tokens} accepted"
              if m.num_draft_tokens else "")
    log.info("request %s: prompt %d tokens (%d cached%s), output %d tokens%s, TTFT %s, TPOT %s, finish_reason %s",
             delta.request_id, m.num_prompt_tokens, delta.num_cached_tokens, sources, m.num_output_tokens, drafts,
             ttft, tpot, delta.finish_reason or "abort")
