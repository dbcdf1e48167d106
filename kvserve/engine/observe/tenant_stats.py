"""Per-tenant usage as of a snapshot: requests, blocks of the pool against the tenant's share, tokens
scheduled. For the admin's lab and /metrics, and for each tenant its own entry (server/core/kv_report.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.scheduler import Scheduler
from kvserve.kv.pool.free_queue import UNOWNED


@dataclass(frozen=True, slots=True)
class TenantStats:
    tenant: str | None  # the server's id of the API key (None: anonymous)
    weight: float
    num_running: int
    num_waiting: int
    num_blocks: int  # blocks of the pool it owns: held by its requests, or free still holding its prefixes
    num_cached_free_blocks: int  # of those, free (evictable, within its share only by itself)
    share_blocks: float  # its fair share of the pool now (kv/pool/tenant_quota.py)
    num_scheduled_tokens: int  # tokens its requests were given in steps (monotonic)


def tenant_stats(scheduler: Scheduler) -> tuple[TenantStats, ...]:
    """Every tenant with requests, blocks or scheduled tokens. Between steps, on the engine's thread."""
    quota, fair = scheduler.kv.pool.quota, scheduler.fair
    running: dict = {}
    waiting: dict = {}
    for request in scheduler.running:
        running[request.tenant] = running.get(request.tenant, 0) + 1
    for request in [*scheduler.waiting, *(r for r, _ in scheduler.loading.values())]:
        waiting[request.tenant] = waiting.get(request.tenant, 0) + 1
    tenants = {*running, *waiting, *fair.tokens, *(t for t, n in quota.held.items() if n > 0 and t != UNOWNED)}
    return tuple(TenantStats(tenant, fair.weight(tenant), running.get(tenant, 0), waiting.get(tenant, 0),
                             quota.held[tenant], quota.cached_free[tenant], quota.share(tenant),
                             fair.tokens[tenant])
                 for tenant in sorted(tenants, key=lambda t: (t is not None, t or "")))
