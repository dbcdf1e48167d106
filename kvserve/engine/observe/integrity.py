"""The engine-wide block accounting check (DESIGN §4), run by tests after every step and on demand."""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.engine.scheduler import Scheduler
from kvserve.errors import KVIntegrityError
from kvserve.kv.tiers.connector import TierConnector, TierLoad


def check_engine_integrity(scheduler: Scheduler, tiers: TierConnector | None,
                           loads_in_flight: Mapping[str, TierLoad]) -> None:
    """Block accounting holds (DESIGN §4), in the pool and in the lower tiers (what they hold and what is
    in flight to them); every running request's tables cover what it computed; every tier read in flight
    fills blocks its request holds, and every request waiting for one has one; raises KVIntegrityError."""
    kv = scheduler.kv
    kv.check_integrity()
    if tiers is not None:
        tiers.check_integrity()
    for request in scheduler.running:
        kv.check_tables(request.request_id, request.num_computed_tokens)
    for request_id, (request, _) in scheduler.loading.items():
        kv.check_tables(request_id, request.num_computed_tokens)
        load = loads_in_flight.get(request_id)
        if load is None:
            raise KVIntegrityError(f"request {request_id} waits for tier blocks that nobody reads")
        if not set(load.block_ids) <= set(kv.block_ids(request_id)[0]):
            raise KVIntegrityError(f"request {request_id}: its tier read fills blocks it does not hold")
    if set(loads_in_flight) - set(scheduler.loading):
        raise KVIntegrityError(f"tier reads in flight for requests not waiting for them: "
                               f"{sorted(set(loads_in_flight) - set(scheduler.loading))}")
    for request in scheduler.waiting:
        if kv.num_blocks_held(request.request_id):
            raise KVIntegrityError(f"waiting request {request.request_id} holds blocks")
    if not scheduler.has_unfinished() and kv.num_free_blocks != kv.num_blocks:
        raise KVIntegrityError(f"blocks leaked: {kv.num_used_blocks} of {kv.num_blocks} are held with no "
                               f"request unfinished")
