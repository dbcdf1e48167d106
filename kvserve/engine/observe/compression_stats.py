"""KV compression (issue 43) as of a snapshot: what compressing requests hold in the pool and what they dropped.

Counted from the KV manager's own tables, so /v1/kv_cache and the lab show the pool's blocks, not an estimate: the
distinct blocks running compressing requests hold (a compressed prefix two of them share counts once), the prompt
tokens their tables no longer hold, and the tokens every compaction took out of the pool since start.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class CompressionStats:
    num_requests: int  # running requests that compress their prompt
    num_blocks: int  # distinct pool blocks those requests hold now (kept blocks of compressed chunks, tail, output)
    num_dropped_tokens: int  # prompt tokens those requests' tables no longer hold now
    num_dropped_tokens_total: int  # monotonic: tokens every compaction took out of the pool (running or not)


def compression_stats(running: list[Request], kv: KVCacheManager) -> CompressionStats:
    """Between steps, on the engine's thread: O(blocks held by compressing requests)."""
    compressing = [request.request_id for request in running if request.request_id in kv.compressed]
    blocks: set[int] = set()
    for request_id in compressing:
        blocks.update(block for table in kv.block_ids(request_id) for block in table)
    return CompressionStats(len(compressing), len(blocks), sum(kv.dropped_tokens(r) for r in compressing),
                            kv.compressed.num_dropped_tokens)
