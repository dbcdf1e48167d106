"""Lower KV tiers: where full blocks go below the pool, and how they come back (DESIGN §3, Tiers).

connector.py   the seam: BlockKey (hash, parent, tokens) and KVTier (lookup, load, store, evict, stats)
stats.py       TierStats / TierCounters: what a tier reports (the engine's snapshot, /metrics)
disk.py        the `disk` tier: one file per block, LRU within a byte capacity, a background writer
disk_files.py  its directory: startup scan, atomic writes, replicas sharing one directory
block_file.py  its file format (fixed header, key, CRC-32, payload; no pickle)
"""
