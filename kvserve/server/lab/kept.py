"""The lab's kept-tokens view: which prompt positions each layer and KV head kept in every compressed chunk of a
request (KV compression, issue 43), from the engine's record (engine/observe/kept_tokens.py).

A chunk goes to the page as one bitmask per layer and head (1: kept), packed little-endian and base64-encoded:
64 bytes per layer and head for a 512-token chunk, where the positions as JSON numbers would be ~20x that.
"""

from __future__ import annotations

import base64

import numpy as np

from kvserve.engine.observe.kept_tokens import ChunkKept, RequestKept


def kept_summary(record: RequestKept) -> dict:
    return {"id": record.request_id, "prompt_tokens": record.num_prompt_tokens, "num_chunks": record.num_chunks,
            "recorded": sorted(record.chunks), "cached": record.cached_chunks, "finished": record.finished}


def kept_json(record: RequestKept) -> dict:
    """The whole record: every chunk it compacted, as bitmasks `[layers][heads]` over the chunk's positions."""
    chunks = [_chunk_json(record.chunks[index]) for index in sorted(record.chunks)]
    shape = record.chunks[min(record.chunks)].kept.shape if record.chunks else (0, 0, 0)
    layer_ids = list(record.chunks[min(record.chunks)].layers) if record.chunks else []
    return {**kept_summary(record), "layers": shape[0], "layer_ids": layer_ids, "kv_heads": shape[1],
            "chunks": chunks}


def _chunk_json(chunk: ChunkKept) -> dict:
    layers, heads, budget = chunk.kept.shape
    mask = np.zeros((layers, heads, chunk.chunk), dtype=bool)
    np.put_along_axis(mask, chunk.kept.numpy().astype(np.int64), True, axis=-1)
    packed = np.packbits(mask, axis=-1, bitorder="little")  # [layers, heads, chunk / 8]
    return {"index": chunk.chunk_index, "first_position": chunk.first_position, "chunk": chunk.chunk,
            "budget": budget, "kept": base64.b64encode(packed.tobytes()).decode("ascii")}
