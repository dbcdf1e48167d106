"""/v1/kv_cache's body: the pool right now, with a block-accounting check, as the caller may see it.

Who sees what (README, "Tenants"): the admin key, or anyone on a server without tenant keys, sees
the whole report. A tenant sees
- the pool's geometry (blocks, block size, bytes per token, dtype, KV groups; a hybrid model's
  recurrent-state slots and their size): the server's configuration, the same for everyone;
- the pool's occupancy now (used / free / cached blocks, live / snapshot state slots, requests
  running / waiting) and the integrity check: the load every client meets anyway as latency and
  429s, and what a client waits on before a benchmark; a sum over everyone, with no request or
  tenant in it;
- its own pins (key, blocks, expiry), their count and blocks, and the pool's pin cap;
- its own usage (`tenants`: its requests, the blocks it owns against its fair share, tokens scheduled),
  never another tenant's.
It does not see another tenant's pins, nor the pool's counters since start (prefix-cache queries
and hits, preemptions, steps, pins created / refreshed / expired / lapsed, cache writes, the disk
tier's traffic, state snapshots evicted): those add up everyone's history, and a tenant polling
them around its own requests would read off how much the others send and reuse. They stay on /metrics (see
--metrics-key) and in the admin's report.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from kvserve.engine.engine import Engine
from kvserve.errors import KVIntegrityError
from kvserve.kv.state.state_spec import state_spec
from kvserve.server.core.pin_owners import PinOwners

TENANT_FIELDS = (
    "block_size", "num_blocks", "num_used_blocks", "num_free_blocks", "num_cached_blocks", "num_cached_free_blocks",
    "capacity_tokens", "bytes_per_token", "kv_groups", "dtype", "pool_bytes", "num_requests_running",
    "num_requests_waiting", "integrity",
)


def kv_cache_report(engine: Engine) -> dict:
    """The whole report. Run between steps: the snapshot is then the pool as it is now."""
    engine.expire_pins()  # an idle engine runs no step that would sweep them
    stats = engine.stats()
    layout = engine.kv_spec.layout
    try:
        engine.check_integrity()
        integrity = "ok"
    except KVIntegrityError as exc:
        integrity = f"FAILED: {exc}"
    return {
        "block_size": stats.block_size, "num_blocks": stats.num_blocks, "num_used_blocks": stats.num_used_blocks,
        "num_free_blocks": stats.num_free_blocks, "num_cached_blocks": stats.num_cached_blocks,
        "num_cached_free_blocks": stats.num_cached_free_blocks,
        # Tokens every KV group can hold at once (a windowed group frees blocks, so long requests hold fewer).
        "capacity_tokens": stats.num_blocks // layout.num_groups * stats.block_size,
        "bytes_per_token": engine.kv_spec.bytes_per_token,
        "kv_groups": [{"window": group.window, "layers": list(group.layers)} for group in layout.groups],
        "dtype": engine.kv_spec.dtype, "pool_bytes": engine.pool_bytes,
        "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
        "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps, "integrity": integrity,
        # KV compression: prompt tokens compaction took out of the pool so far (its kept blocks are counted above).
        "kv_compression": engine.config.kv_compression, "num_compressed_tokens": stats.num_compressed_tokens,
        # ... and what compressing requests hold now, from the pool's own tables (engine/observe/compression_stats.py)
        "compression": dataclasses.asdict(stats.compression) if stats.compression is not None else None,
        "tier": dataclasses.asdict(stats.tier) if stats.tier is not None else None,
        "pins": dataclasses.asdict(stats.pins) if stats.pins is not None else None,
        "tenants": [dataclasses.asdict(entry) for entry in stats.tenants],
        "recurrent_state": recurrent_state_report(engine),
    }


def recurrent_state_report(engine: Engine) -> dict | None:
    """A hybrid model's recurrent-state slots beside the K/V pool (None for a model whose every layer attends):
    their count and size, how many hold live states and findable snapshots now, evictions, and the formula."""
    states = engine.stats().states
    if states is None:
        return None
    kinds = Counter(states.slot_kinds)
    return {
        "slots": states.num_slots, "slot_bytes": states.slot_bytes, "live": states.num_live,
        "snapshots": states.num_snapshots, "working": kinds["working"], "free": kinds["free"],
        "held": states.num_held, "evicted": states.num_evicted, "snapshot_interval": states.snapshot_interval,
        "formula": state_spec(engine.loaded.config).formula(),
    }


def tenant_view(report: dict, tenant: str, owners: PinOwners) -> dict:
    """What of `report` the tenant `tenant` may see (the module docstring says why)."""
    view = {name: report[name] for name in TENANT_FIELDS}
    view["visible_to"] = "tenant"
    pins = report["pins"]
    if pins is not None:
        own = [pin for pin in pins["pins"] if owners.owner(pin["key"]) == tenant]
        pins = {"num_pins": len(own), "num_pinned_blocks": sum(pin["num_blocks"] for pin in own),
                "max_pinned_blocks": pins["max_pinned_blocks"], "pins": own}
    view["pins"] = pins
    view["tenants"] = [entry for entry in report["tenants"] if entry["tenant"] == tenant]  # its own usage only
    states = report["recurrent_state"]  # the slots' geometry and occupancy; evictions are everyone's history
    view["recurrent_state"] = {k: v for k, v in states.items() if k != "evicted"} if states is not None else None
    return view
