"""What a lower tier reports: its counters (kept under the tier's own lock) and one snapshot of them.

The engine's stats snapshot carries a TierStats; /metrics and /v1/kv_cache read it from there.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds (seconds) of the load-time histogram: one load is one request's run of blocks.
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's counters (monotonic unless noted) and state, for the engine's stats snapshot."""

    kind: str  # "disk"
    location: str  # where it lives (the directory)
    enabled: bool  # False once it has disabled itself (disk full, unwritable)
    capacity_bytes: int
    bytes_used: int  # now
    num_blocks: int  # blocks held now
    pending_writes: int  # blocks queued for the background writer now
    query_tokens: int  # tokens looked up past the pool's match
    hit_tokens: int  # tokens loaded back into the pool
    blocks_written: int
    bytes_written: int
    blocks_read: int
    bytes_read: int
    blocks_evicted: int  # dropped for capacity (LRU)
    bytes_evicted: int
    writes_dropped: int  # not written: the writer was too far behind, or the tier was disabled
    files_rejected: int  # truncated, corrupted or foreign files found, skipped and removed
    load_seconds_buckets: tuple[int, ...]  # count of loads <= each LOAD_SECONDS_BUCKETS bound (cumulative)
    load_seconds_count: int
    load_seconds_sum: float


@dataclass(slots=True)
class TierCounters:
    """A tier's monotonic counters; the tier keeps them under its own lock."""

    query_tokens: int = 0
    hit_tokens: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_evicted: int = 0
    bytes_evicted: int = 0
    writes_dropped: int = 0
    files_rejected: int = 0
    load_seconds_count: int = 0
    load_seconds_sum: float = 0.0
    load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_SECONDS_BUCKETS))  # not cumulative

    def record_load(self, num_tokens: int, elapsed_s: float) -> None:
        """One load of a request's run of blocks: `num_tokens` tokens came back in `elapsed_s` seconds."""
        self.hit_tokens += num_tokens
        self.load_seconds_count += 1
        self.load_seconds_sum += elapsed_s
        slot = bisect.bisect_left(LOAD_SECONDS_BUCKETS, elapsed_s)
        if slot < len(self.load_buckets):
            self.load_buckets[slot] += 1

    def snapshot(self, kind: str, location: str, enabled: bool, capacity_bytes: int, bytes_used: int,
                 num_blocks: int, pending_writes: int) -> TierStats:
        cumulative, running = [], 0
        for count in self.load_buckets:
            running += count
            cumulative.append(running)
        return TierStats(
            kind=kind, location=location, enabled=enabled, capacity_bytes=capacity_bytes, bytes_used=bytes_used,
            num_blocks=num_blocks, pending_writes=pending_writes, query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens, blocks_written=self.blocks_written, bytes_written=self.bytes_written,
            blocks_read=self.blocks_read, bytes_read=self.bytes_read, blocks_evicted=self.blocks_evicted,
            bytes_evicted=self.bytes_evicted, writes_dropped=self.writes_dropped,
            files_rejected=self.files_rejected, load_seconds_buckets=tuple(cumulative),
            load_seconds_count=self.load_seconds_count, load_seconds_sum=self.load_seconds_sum,
        )
