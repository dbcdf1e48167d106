"""The engine-wide block accounting check (DESIGN §4), run by tests after every step and on demand."""

from __future__ import annotations

from kvserve.engine.scheduler import Scheduler
from kvserve.engine.tiering import TierTraffic
from kvserve.errors import KVIntegrityError


def check_engine_integrity(scheduler: Scheduler, tiering: TierTraffic | None) -> None:
    """Block accounting holds (DESIGN §4), in the pool and in a lower tier (what it holds and what is in
    flight to it); every running request's tables cover what it computed; raises KVIntegrityError."""
    kv = scheduler.kv
    kv.check_integrity()
    if tiering is not None:
        tiering.tier.check_integrity()
    for request in scheduler.running:
        kv.check_tables(request.request_id, request.num_computed_tokens)
    for request in scheduler.waiting:
        if kv.num_blocks_held(request.request_id):
            raise KVIntegrityError(f"waiting request {request.request_id} holds blocks")
    if not scheduler.has_unfinished() and kv.num_free_blocks != kv.num_blocks:
        raise KVIntegrityError(f"blocks leaked: {kv.num_used_blocks} of {kv.num_blocks} are held with no "
                               f"request unfinished")
