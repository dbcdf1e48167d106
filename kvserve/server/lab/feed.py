"""The live feed: the engine's stats snapshot as JSON, pushed as Server-Sent Events a few times a second.

Everything here reads `Engine.stats()` (an immutable snapshot taken between
steps); nothing reaches into the scheduler or the KV manager. The per-block
view is O(blocks) to build, so the engine builds it only when asked: each tick
of a connected feed asks for one (`Engine.request_block_view`, run between
steps), and the next snapshot carries it. With no page open nothing is asked
for and the engine pays nothing. A view is sent only when it is a new one, so
an idle server sends a few hundred bytes per tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.spec_decode.slots import StepDrafts
from kvserve.engine.observe.stats import BlockView, EngineStats, RequestStats
from kvserve.kv.state.manager import StateStats

FEED_INTERVAL_S = 0.25  # four updates a second: live to the eye, a rounding error for the engine
_FRESH_POLLS = 1000  # x 10 ms: longer than any step; past it the newest snapshot is returned as it is


@dataclass
class FeedSettings:
    interval_s: float = FEED_INTERVAL_S


def block_view_json(view: BlockView) -> dict:
    """Compact: ref counts as a list, hashed flags as a '0'/'1' string, tables by request id, the draft
    slots the view's step wrote (None with drafting off), and a hybrid model's state slots (else None)."""
    return {
        "step": view.num_steps,
        "ref": list(view.ref_counts),
        "hashed": "".join("1" if hashed else "0" for hashed in view.hashed),
        "tables": {request_id: list(block_ids) for request_id, block_ids in view.tables},
        "counts": view.state_counts(),
        "drafts": draft_slots_json(view.drafts) if view.drafts is not None else None,
        # The recurrent-state slots at the view's step, so the page draws both kinds at one moment.
        "states": state_slots_json(view.states) if view.states is not None else None,
    }


def _flat(slots: tuple[tuple[int, int], ...]) -> list[int]:
    return [number for slot in slots for number in slot]


def draft_slots_json(drafts: StepDrafts) -> list[dict]:
    """A step's draft slots per request, as flat [block, offset, block, offset, ...] lists."""
    return [{"id": r.request_id, "written": _flat(r.written), "rolled_back": _flat(r.rolled_back),
             "freed_blocks": list(r.freed_blocks)} for r in drafts.requests]


def draft_counts_json(drafts: StepDrafts) -> dict:
    """Draft tokens written, accepted and rolled back (and blocks the rollbacks freed): the last step's and in total."""
    return {
        "step": drafts.num_steps,
        "last": {"written": drafts.num_written, "accepted": drafts.num_accepted,
                 "rolled_back": drafts.num_rolled_back, "freed_blocks": drafts.num_freed_blocks},
        "total": {"written": drafts.total_written, "accepted": drafts.total_accepted,
                  "rolled_back": drafts.total_rolled_back, "freed_blocks": drafts.total_freed_blocks},
    }


def _request_json(r: RequestStats) -> dict:
    return {
        "id": r.request_id, "status": r.status, "prompt": r.num_prompt_tokens, "cached": r.num_cached_tokens,
        "computed": r.num_computed_tokens, "output": r.num_output_tokens, "blocks": r.num_blocks,
        "preemptions": r.num_preemptions, "ttft": r.ttft, "tpot": r.tpot,
        "dropped": r.num_dropped_tokens,  # prompt tokens KV compression took out of its blocks now
    }


STATE_KIND_LETTERS = {"live": "l", "snapshot": "s", "working": "w", "free": "f"}


def state_slots_json(states: StateStats) -> dict:
    """A hybrid model's recurrent-state slots: counts, and each slot's kind as one letter (l: live, s: snapshot,
    w: working, f: free) in slot order. Sent with every snapshot: there are far fewer slots than blocks."""
    return {
        "slots": states.num_slots, "slot_bytes": states.slot_bytes, "live": states.num_live,
        "held": states.num_held, "snapshots": states.num_snapshots, "evicted": states.num_evicted,
        "snapshot_interval": states.snapshot_interval,
        "kinds": "".join(STATE_KIND_LETTERS[kind] for kind in states.slot_kinds),
    }


def snapshot_json(stats: EngineStats, include_blocks: bool = True) -> dict:
    """One snapshot as the lab's pages read it."""
    return {
        "t": stats.taken_at,
        "step": stats.num_steps,
        "pool": {
            "block_size": stats.block_size, "num_blocks": stats.num_blocks, "used": stats.num_used_blocks,
            "free": stats.num_free_blocks, "cached": stats.num_cached_blocks,
            "cached_free": stats.num_cached_free_blocks,
        },
        "counters": {
            "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
            "preemptions": stats.num_preemptions, "generated_tokens": stats.num_generated_tokens,
        },
        "last_step": {"tokens": stats.last_step.num_tokens, "reused": stats.last_step.num_reused_tokens},
        "running": [_request_json(r) for r in stats.running],
        "waiting": [_request_json(r) for r in stats.waiting],
        "blocks": block_view_json(stats.blocks) if include_blocks and stats.blocks is not None else None,
        "drafts": draft_counts_json(stats.draft_slots) if stats.draft_slots is not None else None,
        "states": state_slots_json(stats.states) if stats.states is not None else None,  # None: no recurrent layers
        "compression": dataclasses.asdict(stats.compression) if stats.compression is not None else None,
        # Per-tenant usage (the lab is the admin's: every tenant, by its id, never its key).
        "tenants": [{"tenant": t.tenant, "weight": t.weight, "running": t.num_running, "waiting": t.num_waiting,
                     "blocks": t.num_blocks, "cached_free": t.num_cached_free_blocks, "share": t.share_blocks,
                     "scheduled_tokens": t.num_scheduled_tokens} for t in stats.tenants],
    }


async def fresh_snapshot(async_engine: AsyncEngine) -> EngineStats:
    """A snapshot with a block view of the current step: asked for between steps, then read once the
    next snapshot (end of the step in flight, or at once when idle) carries it."""
    engine = async_engine.engine
    await async_engine.call(engine.request_block_view)
    stats = engine.stats()
    for _ in range(_FRESH_POLLS):
        if stats.blocks is not None and stats.blocks.num_steps >= stats.num_steps:
            break
        await asyncio.sleep(0.01)
        stats = engine.stats()
    return stats


async def feed_events(async_engine: AsyncEngine, settings: FeedSettings) -> AsyncIterator[str]:
    """SSE events until the client goes away (the response task is then cancelled) or the server begins
    to shut down: an open page must not hold a graceful shutdown up for its whole timeout."""
    engine = async_engine.engine
    last_view: BlockView | None = None
    while not async_engine.draining:
        await async_engine.call(engine.request_block_view)
        stats = engine.stats()
        payload = snapshot_json(stats, include_blocks=stats.blocks is not last_view)
        last_view = stats.blocks
        yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
        await asyncio.sleep(settings.interval_s)
