"""Recurrent state as a cache kind: what hybrid models' recurrent layers keep per request (kv/state/context.py
is the model's seam; the slots, snapshots and their accounting live beside it)."""
