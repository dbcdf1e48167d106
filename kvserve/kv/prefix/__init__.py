"""Prefix caching: hashing.py (stable block hashes: the same tokens and salt give the same digest in every
process), prefix_cache.py (lookups, misses explained, full blocks registered), pins.py (cache breakpoints
with a TTL, evicted last)."""
