"""A request's place among its own API key's requests: vLLM's `priority` and OpenAI's `service_tier`.

Both only order a tenant's own requests (engine/fair_share.py): no field a client sends can take another
API key's share of the server. `priority` is vLLM's (an integer, lower first, default 0). `service_tier` is
accepted as OpenAI sends it: "priority" goes ahead of the key's ordinary requests (-1), "flex" behind them
(+1), "auto", "default" and "scale" are ordinary (0). A `priority` given wins over the tier.
"""

from __future__ import annotations

from typing import Literal

from kvserve.errors import InvalidRequestError

PRIORITY_RANGE = (-(2**31), 2**31 - 1)
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
_TIER_PRIORITY = {"priority": -1, "flex": 1}


def request_priority(priority: int | None, service_tier: str | None) -> int:
    """The scheduling priority of a request with these fields (lower first)."""
    if priority is not None:
        if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            raise InvalidRequestError(f"priority must be within [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], "
                                      f"got {priority}", param="priority")
        return priority
    return _TIER_PRIORITY.get(service_tier or "default", 0)
