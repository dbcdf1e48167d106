"""The KV cache: the core of the product. The coordinator (manager.py) is the one door; the rest are its rooms.

manager.py        KVCacheManager: allocate, free, truncate, block ids, fit, integrity, prefix matches (one
                  lookup: the pool's hit and the tiers' continuation)
context_shift.py  llama.cpp's context shift: which tokens go, and the K/V moves
pool/             physical blocks: block_pool.py (ids, ref counts, events), free_queue.py (the LRU free
                  queue), block_updates.py (what the runner's block tables gain each step)
groups/           layers that share block tables: layout.py (the KV groups, windows), group_manager.py (one
                  group's tables), full.py and window.py (one manager per attention kind)
prefix/           prefix caching: hashing.py (stable block hashes), prefix_cache.py (lookups, misses explained,
                  full blocks registered), pins.py (cache breakpoints with a TTL)
cache/            the tensors and their bytes: kv_spec.py (the one bytes-per-token formula), quant.py (int8 /
                  int4 / fp8 codecs), storage.py (paged tensors), open_blocks.py (int4 keys' float16 block being
                  filled), fingerprint.py (what produced a block's K/V)
tiers/            lower tiers below the pool, behind one connector (disk first)
events/           events.py (stored / removed: tiers and routers subscribe), wire.py (vLLM's wire format)
attention/        the attention backend seam and its CPU kernels
"""
