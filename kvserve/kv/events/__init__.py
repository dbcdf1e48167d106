"""What the pool tells its subscribers: events.py (BlockStored / BlockRemoved / AllBlocksCleared), wire.py (the
same in vLLM's KV-event wire schema, for ZMQ publishers and routers)."""
