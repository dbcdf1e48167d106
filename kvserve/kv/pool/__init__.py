"""Physical KV blocks: block_pool.py (ids, reference counts, the cache events it emits), free_queue.py (a
block's record and the LRU free queue through it), block_updates.py (what a request's block tables gained since
the runner last saw them)."""
