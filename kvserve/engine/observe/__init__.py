"""What the engine shows outside: stats.py (one snapshot, taken between steps), snapshots.py (the counters it is
built from), integrity.py (the block accounting check, DESIGN §4), kv_publisher.py (cache events on ZMQ)."""
