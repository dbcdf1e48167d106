"""Fair sharing of a step's token budget between tenants: weighted, work-conserving, deficit-style. No tensors.

A tenant is whoever the server says sent the request (its API key's id; None for the anonymous one).
Decodes go first and are never shared out (decode-first: a token each, the cheapest work there is); what
is left of the step's budget goes to prefill chunks and admissions, shared by weight between the tenants
that have such work. Each tenant gets up to its share (budget x weight / weights of tenants with work),
in rounds of one request per tenant, least-served tenant first; budget a tenant cannot use (it has no more
work, or its next request cannot get blocks) then goes to the others, least-served first, so one tenant
alone keeps the whole machine. One exception keeps first tokens quick: in a step where a request reaches
its first token while another tenant has work, no tenant gets more than its weighted share of the step and the
leftover is not handed out (the step is no longer than the shares make it: a quiet tenant's short prompt runs
beside half a step of the flood, not a whole one; the heavy tenant gives up part of one step per first token
of the other's). How long a step may be at all while several requests have work is engine/step_budget.py's.

"Least served" is the tokens a tenant was given, over its weight, counted across steps (DRR's deficit):
a tenant that starts to have work again starts at the least-served active tenant's count, so an idle spell
is not saved up into a burst that shuts the others out.

Within a tenant: prefill chunks of its running requests first (admission order), then its waiting
requests by `priority` (lower first; vLLM's field), first come first served within a priority.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

Tenant = Hashable  # str | None
R = TypeVar("R")
T = TypeVar("T")

# Serve one item with at most `cap` tokens: the tokens it took (0: it took none, try the tenant's next),
# or None: this tenant's later items must wait (FCFS within a tenant, e.g. no blocks for its next request).
ServeFn = Callable[[T, int], "int | None"]


class FairShare:
    """Per-tenant weights and served-token counts; shares out a step's budget (`share`)."""

    def __init__(self, weights: Mapping[Tenant, float] | None = None) -> None:
        self.weights: dict[Tenant, float] = {}
        self.served: dict[Tenant, float] = {}  # tokens given / weight, since the tenant last had work
        self._active: set[Tenant] = set()
        self.tokens: Counter = Counter()  # tokens given per tenant (monotonic, for its stats)
        if weights:
            self.set_weights(weights)

    def set_weights(self, weights: Mapping[Tenant, float]) -> None:
        """Weights by tenant (default 1.0 each); a weight must be positive."""
        for tenant, weight in weights.items():
            if not weight > 0:
                raise ValueError(f"a tenant's weight must be positive, not {weight!r}")
        self.weights = dict(weights)

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Count `tokens` given to `tenant` outside `share` (its decodes)."""
        self.served[tenant] = self.served.get(tenant, 0.0) + tokens / self.weight(tenant)
        self.tokens[tenant] += tokens

    def begin_step(self, tenants_with_work: Iterable[Tenant]) -> None:
        """Note who has work this step: a tenant back from idle starts at the least-served active count."""
        active = set(tenants_with_work)
        returning = active - self._active
        staying = [self.served.get(tenant, 0.0) for tenant in active - returning]
        floor = min(staying) if staying else min((self.served.get(t, 0.0) for t in active), default=0.0)
        for tenant in returning:
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
        for tenant in set(self.served) - active:
            if tenant not in self.weights:  # forget idle tenants nobody configured (bounded state)
                del self.served[tenant]
        self._active = active

    def order(self, tenants: Iterable[Tenant]) -> list[Tenant]:
        """Least served first (ties in the order given)."""
        return sorted(tenants, key=lambda tenant: self.served.get(tenant, 0.0))

    def victim(self, running: list[R], tenant_of: Callable[[R], Tenant], blocks_held: Callable[[str], int]) -> R:
        """Whom to preempt when the pool runs dry: the most recently admitted of `running` (admission order)
        of the tenant holding the most blocks for its weight (`blocks_held` by request id; one tenant: the most
        recently admitted)."""
        held: dict[Tenant, float] = {}
        for request in running:
            held[tenant_of(request)] = held.get(tenant_of(request), 0.0) + blocks_held(request.request_id)
        heaviest = max(held, key=lambda tenant: held[tenant] / self.weight(tenant))
        return next(request for request in reversed(running) if tenant_of(request) == heaviest)

    def reclaim_victim(self, running: list[R], tenant: Tenant, tenant_of: Callable[[R], Tenant],
                       over_share: Callable[[Tenant], float]) -> R | None:
        """Whom to preempt so that `tenant`, under its share of the pool and short of blocks, gets in: the
        most recently admitted running request of the tenant furthest over its share (None: nobody is)."""
        if over_share(tenant) >= 0:
            return None
        others = {tenant_of(request) for request in running} - {tenant}
        over = {other: over_share(other) for other in others}
        heaviest = max((other for other in over if over[other] > 0), key=over.get, default=None)
        if heaviest is None:
            return None
        return next(request for request in reversed(running) if tenant_of(request) == heaviest)

    def share(self, queues: Mapping[Tenant, list[T]], budget: int, serve: ServeFn,
              demand: Callable[[T], int], refill: Callable[[], bool] = lambda: True) -> int:
        """Give the queues' items tokens from `budget`, fairly (module doc); `demand(item)` is at most how many
        tokens an item could take this step. Every tenant first gets up to its weighted share; with several
        tenants, what the shares left over is handed out (water-filled by weight, then to anyone) only if
        `refill()`: a step that brings a request to its first token stays as short as the shares make it
        (the module doc). Returns the budget left."""
        queues = {tenant: list(items) for tenant, items in queues.items() if items}
        if not queues or budget <= 0:
            return budget
        several = len(queues) > 1
        # Each tenant up to its weighted share first: whether a first token comes in this step is known after.
        budget = self._rounds(queues, budget, self.weighted_shares(self._demands(queues, demand), budget), serve)
        if several and not refill():
            return budget  # a first token: the step stays as short as the shares make it
        if budget > 0 and any(queues.values()):  # what one tenant did not need, water-filled by weight
            budget = self._rounds(queues, budget, self.caps(self._demands(queues, demand), budget), serve)
        if budget > 0 and any(queues.values()):  # the rest to whoever can still use it
            budget = self._rounds(queues, budget, {tenant: budget for tenant in queues}, serve)
        return budget

    def weighted_shares(self, demands: Mapping[Tenant, int], budget: int) -> dict[Tenant, int]:
        """Each tenant's share of `budget` by weight among the tenants asking, no more than it asks for."""
        total_weight = sum(self.weight(tenant) for tenant, need in demands.items() if need > 0)
        return {tenant: min(need, max(1, int(budget * self.weight(tenant) / total_weight))) if need > 0 else 0
                for tenant, need in demands.items()}

    @staticmethod
    def _demands(queues: Mapping[Tenant, list[T]], demand: Callable[[T], int]) -> dict[Tenant, int]:
        return {tenant: sum(demand(item) for item in items) for tenant, items in queues.items() if items}

    def caps(self, demands: Mapping[Tenant, int], budget: int) -> dict[Tenant, int]:
        """Each tenant's tokens this step by weighted water-filling: no more than it asks for, and what a
        tenant does not ask for shared by weight among those that ask for more."""
        caps = {tenant: 0 for tenant in demands}
        hungry = {tenant for tenant, need in demands.items() if need > 0}
        left = budget
        while hungry and left > 0:
            total_weight = sum(self.weight(tenant) for tenant in hungry)
            shares = {tenant: max(1, int(left * self.weight(tenant) / total_weight)) for tenant in hungry}
            given = 0
            for tenant in self.order(hungry):
                take = min(shares[tenant], demands[tenant] - caps[tenant], left - given)
                caps[tenant] += take
                given += take
            hungry = {tenant for tenant in hungry if caps[tenant] < demands[tenant]}
            left -= given
            if given == 0:
                break
        return caps

    def _rounds(self, queues: dict[Tenant, list[T]], budget: int, caps: dict[Tenant, int], serve: ServeFn) -> int:
        """One item per tenant per round, least served first, each within its cap, until nothing moves."""
        moved = True
        while moved and budget > 0:
            moved = False
            for tenant in self.order(tenant for tenant, items in queues.items() if items):
                room = min(caps[tenant], budget)
                items = queues[tenant]
                while items and room > 0:
                    used = serve(items[0], room)
                    if used is None:
                        items.clear()  # blocked: its later items wait for a later step
                        break
                    items.pop(0)
                    if used:
                        caps[tenant] -= used
                        budget -= used
                        self.charge(tenant, used)
                        moved = True
                        break  # one item per tenant per round
        return budget


def tenant_queues(prefilling: Iterable[R], waiting: Iterable[R], tenant_of: Callable[[R], Tenant],
                  priority_of: Callable[[R], int]) -> dict[Tenant, list[R]]:
    """Each tenant's work in its order: running requests' prefill chunks (as given: admission order), then
    waiting requests by priority, lower first, in the order given within a priority."""
    queues: dict[Tenant, list[R]] = {}
    for request in prefilling:
        queues.setdefault(tenant_of(request), []).append(request)
    for request in sorted(waiting, key=priority_of):  # stable: arrival (preempted first) within a priority
        queues.setdefault(tenant_of(request), []).append(request)
    return queues
