"""The pool's cache events in vLLM's wire schema (vllm/distributed/kv_events.py), ready for msgpack.

vLLM encodes its events with msgspec as tagged, array-like structs: each event
is an array whose first element is the class name, then its fields in order,
with trailing fields left at their default omitted. A batch is
`[ts, [event, ...], data_parallel_rank]`. Consumers (Dynamo, llm-d, Ray's
KV-aware router, vLLM's own example subscriber) decode that; this module
writes exactly those arrays from kvserve's events (kv/events/events.py), so a router
written for vLLM reads kvserve replicas unchanged.

    BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, lora_name(, extra_keys, group_idx)]
    BlockRemoved     ["BlockRemoved", block_hashes, medium(, group_idx)]
    AllBlocksCleared ["AllBlocksCleared"]

Block hashes go out as signed 64-bit integers (vLLM's ExternalBlockHash as
int): the first 8 bytes, big-endian, of kvserve's 16-byte BLAKE2b digest
(kv/prefix/hashing.py). A router that hashes prompts itself uses `external_block_hash`
on kvserve's own chain (tenant salt included) and finds the same numbers.
A chain's first block has no parent (None), as in vLLM; the salt is already
in its hash. Consecutive blocks of one chain are published as one BlockStored
with their token ids concatenated, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Iterable

from kvserve.kv.events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.kv.prefix.hashing import BlockHash

MEDIUM_CPU = "CPU"  # the KV pool: kvserve keeps it in host memory
MEDIUM_DISK = "DISK"  # the disk tier (kv/tiers/disk.py)


def external_block_hash(block_hash: BlockHash) -> int:
    """kvserve's digest as the signed 64-bit integer the events carry."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def encode_events(events: Iterable[tuple[str, KVCacheEvent]], block_size: int) -> list[list[Any]]:
    """(medium, event) pairs, in order, as vLLM's event arrays; runs of one chain's stored blocks (and of
    removed blocks) of one medium and group are merged into one event, order kept."""
    encoded: list[list[Any]] = []
    last_stored: tuple[str, int, BlockHash] | None = None  # (medium, group, hash) the last BlockStored ends with
    last_removed: tuple[str, int] | None = None
    for medium, event in events:
        if isinstance(event, BlockStored):
            external = external_block_hash(event.block_hash)
            if last_stored == (medium, event.group, event.parent_hash) and not event.first:
                encoded[-1][1].append(external)
                encoded[-1][3].extend(event.token_ids)
            else:
                parent = None if event.first else external_block_hash(event.parent_hash)
                fields = ["BlockStored", [external], parent, list(event.token_ids), block_size, None, medium, None]
                if event.group:
                    fields += [None, event.group]  # extra_keys (none: the salt is in the hash), group_idx
                encoded.append(fields)
            last_stored, last_removed = (medium, event.group, event.block_hash), None
        elif isinstance(event, BlockRemoved):
            external = external_block_hash(event.block_hash)
            if last_removed == (medium, event.group):
                encoded[-1][1].append(external)
            else:
                encoded.append(["BlockRemoved", [external], medium] + ([event.group] if event.group else []))
            last_stored, last_removed = None, (medium, event.group)
        elif isinstance(event, AllBlocksCleared):
            encoded.append(["AllBlocksCleared"])
            last_stored = last_removed = None
        else:
            raise TypeError(f"not a KV cache event: {event!r}")
    return encoded


def encode_batch(ts: float, events: list[list[Any]], data_parallel_rank: int | None = None) -> list[Any]:
    """vLLM's KVEventBatch as an array: [ts, events(, data_parallel_rank)]."""
    return [ts, events] if data_parallel_rank is None else [ts, events, data_parallel_rank]
