"""What changed in a request's block tables since the runner last saw them (vLLM's
CachedRequestData.new_block_ids): the runner keeps a persistent block table and
applies these, instead of receiving every table every step.

Appending blocks is the common change and is sent as the new entries only. Any
other change (a request seen for the first time or again after preemption, a
prefix hit, a context shift, a truncation, blocks freed behind a window) makes
the next update a replacement carrying the whole tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvserve.kv.pool.free_queue import KVBlock

# A table position whose block was freed behind a sliding window: the null block, never read.
NULL_BLOCK_ID = -1


@dataclass(frozen=True, slots=True)
class BlockTableUpdate:
    """Per KV group: the whole table (`replace`) or the block ids appended to it since the last update."""

    replace: bool
    block_ids: tuple[tuple[int, ...], ...]


def table_ids(table: Sequence[KVBlock | None]) -> list[int]:
    return [NULL_BLOCK_ID if block is None else block.block_id for block in table]


class BlockTableUpdates:
    """Per request, how many entries of each group's table the runner already has."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}  # a request absent here gets a replacement next

    def changed(self, request_id: str) -> None:
        """The request's tables changed other than by appending (or it is gone): replace them next time."""
        self._sent.pop(request_id, None)

    def take(self, request_id: str, tables: Sequence[Sequence[KVBlock | None]]) -> BlockTableUpdate:
        sent = self._sent.get(request_id)
        self._sent[request_id] = [len(table) for table in tables]
        if sent is None:
            return BlockTableUpdate(True, tuple(tuple(table_ids(table)) for table in tables))
        return BlockTableUpdate(False, tuple(tuple(table_ids(table[start:])) for start, table in zip(sent, tables)))
