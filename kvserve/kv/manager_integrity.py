"""The KV manager's accounting invariants (DESIGN §4): every block held as often as tables hold it, every
state slot as often as requests do, and a running request's tables and state fitting what it computed."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

from kvserve.errors import KVIntegrityError

if TYPE_CHECKING:
    from kvserve.kv.manager import KVCacheManager


def check_manager_integrity(manager: KVCacheManager) -> None:
    """free + used == total; every held block's ref_cnt equals the number of tables holding it; the pins and
    the state slots agree with their holders. Raises KVIntegrityError otherwise."""
    manager.pool.check_integrity()
    manager.pins.check_integrity()
    if manager.states is not None:
        manager.states.check_integrity()
    holders = Counter(block.block_id for group in manager.groups for table in group.tables.values()
                      for block in table if block is not None)
    for block in manager.pool.blocks:
        held_by = holders.get(block.block_id, 0)
        if block.ref_cnt != held_by:
            raise KVIntegrityError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {held_by} tables")
    if manager.num_free_blocks + len(holders) != manager.num_blocks:
        raise KVIntegrityError(f"{manager.num_free_blocks} free + {len(holders)} held blocks != "
                               f"{manager.num_blocks} in the pool")


def check_request_tables(manager: KVCacheManager, request_id: str, num_computed_tokens: int,
                         slot_offsets: Sequence[int] = ()) -> None:
    """A running request's tables are one length, cover its computed tokens and hold every block a
    later query may read (windowed groups: from the window of position `num_computed_tokens` on).
    `slot_offsets`: per group, the tokens its table no longer holds (KV compression; whole blocks): that
    group's table is that much shorter and counts slots. A hybrid model's request has a live state after
    exactly its computed tokens. Raises KVIntegrityError otherwise."""
    offsets = tuple(slot_offsets) or (0,) * len(manager.groups)
    bs = manager.block_size
    lengths = {len(group.tables.get(request_id, ())) + offset // bs for group, offset in zip(manager.groups, offsets)}
    if len(lengths) > 1:
        raise KVIntegrityError(f"request {request_id}: its group tables differ in length")
    for group, offset in zip(manager.groups, offsets):
        held = len(group.tables.get(request_id, ()))
        if held * bs < num_computed_tokens - offset:
            raise KVIntegrityError(f"request {request_id} holds {held} blocks in group {group.group} for "
                                   f"{num_computed_tokens - offset} computed tokens")
        group.check_table(request_id, num_computed_tokens - offset)
    if manager.states is not None:
        manager.states.check_request(request_id, num_computed_tokens)
