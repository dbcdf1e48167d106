"""Lower KV tiers: where full blocks go below the pool, and how they come back (DESIGN §3, Tiers).

One lookup at admission (KVCacheManager.match_prefix) gives the pool's hit and the tiers' continuation;
the scheduler gives the request blocks for both and sets it aside while the runner reads the tier's part
off the compute thread; a block that does not arrive intact is recomputed, never served.

connector.py   the seam: BlockKey, KVTier (one tier: lookup, load, store, evict, stats), TierConnector
               (the list of tiers, disk first), TierHit (a match's tier part), TierLoad, LoadResult
reader.py      TierReader: the reads on a background thread, taken in by the runner between steps
traffic.py     TierTraffic: what loads delivered (a failing tier turned off), the write-through of
               blocks the pool newly cached
stats.py       TierStats / TierCounters: what a tier reports (the engine's snapshot, /metrics)
disk.py        the `disk` tier: one file per block, LRU within a byte capacity, a background writer
disk_files.py  its directory: startup scan, atomic writes, replicas sharing one directory
block_file.py  its file format (fixed header, key, CRC-32, payload; no pickle)

A host-memory tier under a GPU pool would be one more file here and one more entry in the list.

KV compression (issue 43): a compressed chunk's kept blocks go down and come back as they are, under the slot
keys that name their chunk and chain the spec (kv/prefix/compressed_keys.py, compressed_tier.py): their keys
carry the extra keys their hash chains (BlockKey.extra_keys) and their files say so (block_file.py's KVSBLK02),
so only a request with the same prefix and spec reads them, in a later run of the server too.
"""

from kvserve.kv.tiers.connector import BlockKey, KVTier, LoadResult, Payload, TierConnector, TierHit, TierLoad
from kvserve.kv.tiers.stats import LOAD_SECONDS_BUCKETS, TierStats

__all__ = ["LOAD_SECONDS_BUCKETS", "BlockKey", "KVTier", "LoadResult", "Payload", "TierConnector", "TierHit",
           "TierLoad", "TierStats"]
