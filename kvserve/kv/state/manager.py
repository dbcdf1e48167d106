"""Each request's recurrent state: its live slot, the snapshots its steps write, and what they become.

The KV manager's partner for hybrid models (kv/manager.py holds one): it answers the same questions for the
state kind that a KV group's manager answers for its blocks: how long a prefix hit it can serve, what a
request needs to start, what a cut back to N tokens keeps; and it plans each step's slots for the runner.

Where snapshots are taken (all at block boundaries, keyed by the hash of the block they end, so a hit is
the longest prefix for which the attention blocks and a snapshot agree):
- every `snapshot_interval` blocks of a request's chain: prefixes shared by requests that then differ hit
  the last grid point before the fork;
- the last block boundary each step reaches (the request's *tail*): a chat's next turn, or the same request
  after a preemption, resumes where the last one stopped, whatever the interval. A request keeps only its
  newest tail: the one before is dropped when a newer one is registered (unless it is on the grid);
- where a hit's attention blocks went further than any snapshot (a fork between grid points): the request
  that recomputes from the last snapshot writes one there, so the next request with that prefix hits all of it;
- and, with drafts or forced tokens, a checkpoint after every token that may be rejected: a rejection
  swaps the checkpoint in as the live state (no recompute).

Snapshots are best-effort: when no slot is free the step runs without one (only hits get shorter).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.errors import KVIntegrityError
from kvserve.kv.prefix.hashing import BlockHash
from kvserve.kv.state.slots import StateSlots


@dataclass(frozen=True, slots=True)
class StateStats:
    """The state slots between two steps, for the stats snapshot (metrics, /v1/kv_cache, the lab)."""

    num_slots: int
    slot_bytes: int  # one request's state over every recurrent layer
    num_live: int  # running requests' live states
    num_held: int  # slots held by requests (live, being read or written, their tails)
    num_snapshots: int  # findable by prefix hits (held or not)
    num_evicted: int  # snapshots given up for a slot (monotonic)
    snapshot_interval: int  # blocks between grid snapshots
    # Per slot: "live", "snapshot" (findable), "working" (held: read, or written this step) or "free".
    slot_kinds: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StateStep:
    """One request's recurrent state in a step, as slot ids (the runner moves the tensors)."""

    slot: int  # written after the step's last token: the live state from then on
    source: int  # read before its first token (unless the step starts at 0): the live state, or a hit's snapshot
    snapshots: tuple[tuple[int, int], ...] = ()  # (tokens into the step, slot): the state there is kept


class RecurrentStates:
    def __init__(self, num_slots: int, block_size: int, snapshot_interval: int, enable_caching: bool,
                 slot_bytes: int = 0) -> None:
        """`slot_bytes`: what one slot holds (StateSpec.slot_bytes), for the stats."""
        if snapshot_interval < 1:
            raise ValueError("the state snapshot interval is at least one block")
        self.slots = StateSlots(num_slots)
        self.slot_bytes = slot_bytes
        self.block_size = block_size
        self.snapshot_interval = snapshot_interval
        self.enable_caching = enable_caching
        self._live: dict[str, int] = {}  # the slot holding the state after `_position` tokens
        self._position: dict[str, int] = {}  # tokens the live state covers once the planned step has run
        self._read: dict[str, int] = {}  # a slot the request holds only until its next step has run
        self._hit: dict[str, int] = {}  # a prefix hit's snapshot, read by the request's first step
        self._written: dict[str, dict[int, int]] = {}  # position -> slot the last step wrote (held)
        self._tail: dict[str, tuple[int, int]] = {}  # the newest registered off-grid snapshot (held)
        self._fork: dict[str, int] = {}  # a position to snapshot once (a hit's attention part ended there)

    # --- prefix hits -----------------------------------------------------------------------------------

    def longest_hit(self, hashes: Sequence[BlockHash], num_blocks: int) -> int:
        """The most blocks, at most `num_blocks`, after which a snapshot resumes the chain (0: fresh)."""
        for index in range(num_blocks, 0, -1):
            if hashes[index - 1] in self.slots.by_key:
                return index
        return 0

    def snapshot_for(self, hashes: Sequence[BlockHash], num_blocks: int) -> int | None:
        return self.slots.lookup(hashes[num_blocks - 1]) if num_blocks else None

    # --- a request's life ------------------------------------------------------------------------------

    def start(self, request_id: str, num_tokens: int, snapshot: int | None, fork_at: int = 0) -> bool:
        """Give a request its live slot, starting from `snapshot` (a hit of `num_tokens` tokens) or fresh;
        False, and nothing changes, when every slot is held."""
        if snapshot is not None:
            self.slots.hold(snapshot)  # before allocating: the allocation must not evict it
        live = self.slots.allocate()
        if live is None:
            if snapshot is not None:
                self.slots.release(snapshot)
            return False
        self._live[request_id] = live
        self._position[request_id] = num_tokens
        self._written[request_id] = {}
        if snapshot is not None:
            self._hit[request_id] = snapshot
        if fork_at > num_tokens and self.enable_caching:
            self._fork[request_id] = fork_at
        return True

    def started(self, request_id: str) -> bool:
        return request_id in self._live

    def plan_step(self, request_id: str, start: int, count: int, num_speculative: int) -> StateStep:
        """The slots of a step computing tokens start..start+count-1, the last `num_speculative` of them
        forced or drafted (they may be rejected)."""
        if self._position[request_id] != start:
            raise KVIntegrityError(f"request {request_id}: its state covers {self._position[request_id]} tokens, "
                                   f"the step starts at {start}")
        self._release_read(request_id)
        source = self._hit.pop(request_id, None)
        if source is not None:  # the first step reads the hit's snapshot into the live slot
            write = self._live[request_id]
        else:  # later steps read the live slot and write a spare one (in place when none is free)
            source = write = self._live[request_id]
            spare = self.slots.allocate() if start else None  # a step from 0 reads nothing
            if spare is not None:
                write = self._live[request_id] = spare
        if source != write:
            self._read[request_id] = source  # held until the step has run (a retried step reads it again)
        end = start + count
        points = set(range(max(end - num_speculative, start + 1), end))  # checkpoints for a rollback
        if self.enable_caching:
            grid = self.block_size * self.snapshot_interval
            points.update(range((start // grid + 1) * grid, end + 1, grid))
            tail = end // self.block_size * self.block_size
            if tail > start:
                points.add(tail)
            fork = self._fork.get(request_id)
            if fork is not None and start < fork <= end:
                points.add(fork)
        snapshots = []
        written = self._written[request_id]
        for position in sorted(points):
            slot = self.slots.allocate()
            if slot is None:
                break  # snapshots are best-effort: hits get shorter, rollbacks recompute
            written[position] = slot
            snapshots.append((position - start, slot))
        self._position[request_id] = end
        return StateStep(write, source, tuple(snapshots))

    def resumable_tokens(self, request_id: str, num_tokens: int) -> int:
        """`num_tokens` if the request has its state after that many tokens; else 0 (start fresh)."""
        if self._position.get(request_id) == num_tokens or num_tokens in self._written.get(request_id, ()):
            return num_tokens
        return 0

    def cut(self, request_id: str, num_tokens: int) -> None:
        """Make the live state the one after `num_tokens` tokens (as `resumable_tokens` allows): a
        checkpoint becomes the live slot, or the state starts fresh at 0."""
        if request_id not in self._live or self._position[request_id] == num_tokens:
            return
        slot = self._written[request_id].pop(num_tokens, None)
        if slot is None:
            if num_tokens:
                raise KVIntegrityError(f"request {request_id} has no state after {num_tokens} tokens")
        else:
            self.slots.release(self._live[request_id])
            self._live[request_id] = slot
        self._position[request_id] = num_tokens

    def after_step(self, request_id: str, num_computed_tokens: int, hashes: Sequence[BlockHash]) -> None:
        """The step ran and kept `num_computed_tokens`: its snapshots at block boundaries within them are
        registered under their chains' hashes (`hashes`: the request's full blocks so far), the rest given up."""
        self._release_read(request_id)
        written = self._written.get(request_id)
        if not written:
            return
        grid = self.block_size * self.snapshot_interval
        for position, slot in sorted(written.items()):
            index = position // self.block_size
            keep = (self.enable_caching and position <= num_computed_tokens and position % self.block_size == 0
                    and 0 < index <= len(hashes) and self.slots.register(slot, hashes[index - 1]))
            if position == self._fork.get(request_id):
                del self._fork[request_id]  # kept like a grid point, written or not
            elif keep and position % grid:
                self._new_tail(request_id, position, slot)
                continue  # the request holds its tail
            self.slots.release(slot)
        written.clear()

    def free(self, request_id: str) -> None:
        """The request is done (finished, aborted, preempted): its holds go; its snapshots stay findable."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.slots.release(live)
        self._release_read(request_id)
        for slot in [self._hit.pop(request_id, None), *self._written.pop(request_id, {}).values()]:
            if slot is not None:
                self.slots.release(slot)
        tail = self._tail.pop(request_id, None)
        if tail is not None:
            self.slots.release(tail[1])
        self._position.pop(request_id, None)
        self._fork.pop(request_id, None)

    def _new_tail(self, request_id: str, position: int, slot: int) -> None:
        old = self._tail.get(request_id)
        self._tail[request_id] = (position, slot)
        if old is not None:
            if self.slots.ref_cnt[old[1]] == 1:  # nobody else reads it: an old tail is not worth a slot
                self.slots.unregister(old[1])
            self.slots.release(old[1])

    def _release_read(self, request_id: str) -> None:
        slot = self._read.pop(request_id, None)
        if slot is not None:
            self.slots.release(slot)

    # --- views -----------------------------------------------------------------------------------------

    def live_slot(self, request_id: str) -> int | None:
        return self._live.get(request_id)

    def held_by(self, request_id: str) -> list[int]:
        """Every slot the request holds (live, snapshots it wrote or reads)."""
        slots = [self._live.get(request_id), self._hit.get(request_id), self._read.get(request_id),
                 *self._written.get(request_id, {}).values(), self._tail.get(request_id, (0, None))[1]]
        return [slot for slot in slots if slot is not None]

    def stats(self) -> StateStats:
        live = set(self._live.values())
        slots = self.slots
        kinds = tuple("live" if slot in live else "snapshot" if slots.key_of[slot] is not None
                      else "working" if slots.ref_cnt[slot] else "free" for slot in range(slots.num_slots))
        return StateStats(slots.num_slots, self.slot_bytes, len(live), slots.num_held, slots.num_snapshots,
                          slots.num_evicted, self.snapshot_interval, kinds)

    def check_request(self, request_id: str, num_computed_tokens: int) -> None:
        """A running request has a live state, and it is the state after its computed tokens."""
        if request_id not in self._live:
            raise KVIntegrityError(f"request {request_id} runs without a recurrent state")
        if self._position[request_id] != num_computed_tokens:
            raise KVIntegrityError(f"request {request_id}: its recurrent state covers {self._position[request_id]} "
                                   f"tokens, it has computed {num_computed_tokens}")

    def check_integrity(self) -> None:
        holders = Counter(slot for request_id in self._live for slot in self.held_by(request_id))
        self.slots.check_integrity(holders)
