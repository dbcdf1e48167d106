"""The cache's tensors and their bytes: kv_spec.py (bytes per token: the one formula the planner, the pool and
the lab share), quant.py (element codecs), storage.py (the paged K/V tensors), open_blocks.py (blocks still
being filled, for per-block key codecs), fingerprint.py (what produced a block's K/V, for lower tiers)."""
