"""A compressed chunk's K/V moved within the paged pool: per layer and KV head, the kept rows packed into the chunk's
first blocks (kv/compressed_chunks.py plans which; the runner calls this between a forward and the next).

Scores read the chunk's keys as the pool holds them, decoded to float32 (float, int8, fp8 and int8/int4 caches
alike), so the kept set is a function of the chunk's stored K/V. The rows themselves move as stored bytes (data and
per-row parameters), never decoded and re-encoded: a kept token is the same bits before and after, and a chunk
that keeps every token is the very cache it was. A blockwise codec (parameters per block) cannot move rows that
way: the engine refuses it with compression (engine_spec.EngineSupport), as it does shared and packed layers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.kv.attention.base import AttentionBackend
from kvserve.kv.cache.storage import PagedKVCache
from kvserve.kv.compressed_chunks import Compaction
from kvserve.kv.compression.scoring import SCORERS, PromptKV
from kvserve.kv.compression.select import keep_top
from kvserve.kv.compression.spec import CompressionSpec


def chunk_slots(backend: AttentionBackend, cache: PagedKVCache, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """Flat rows `[num_tokens, KVH]` of the first `num_tokens` tokens laid out in `blocks`, in token order."""
    bs = cache.block_size
    device = cache.device
    block_ids = torch.tensor(blocks, dtype=torch.long, device=device).repeat_interleave(bs)[:num_tokens]
    rows = torch.arange(num_tokens, device=device) % bs
    return backend.token_slots(cache, block_ids, rows).view(num_tokens, cache.spec.num_kv_heads)


def kept_indices(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, spec: CompressionSpec,
                 budget: int, sinks: int) -> torch.Tensor:
    """One layer's chunk K/V `[KVH, C, D]` at `positions` `[C]` -> kept indices `[KVH, budget]`, ascending."""
    if budget >= keys.shape[1]:
        return torch.arange(keys.shape[1], device=keys.device).expand(keys.shape[0], -1)
    scores = SCORERS[spec.method](PromptKV(keys, values, positions))
    return keep_top(scores, budget, sinks, 0)  # the recent tail is exact already: it lies past the chunk


def compact_chunk(backend: AttentionBackend, cache: PagedKVCache, compaction: Compaction, spec: CompressionSpec,
                  layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Compress one chunk in place in `layers` (those of the compaction's KV group: its blocks are that group's
    pages; None: every stored layer, a model of one group), `spec` a resolved engine spec; returns each layer's
    kept indices `[KVH, budget]` (the lab, tests)."""
    chunk = len(compaction.src_blocks) * cache.block_size
    budget = compaction.num_kept_blocks * cache.block_size
    src = chunk_slots(backend, cache, list(compaction.src_blocks), chunk)
    dst = chunk_slots(backend, cache, list(compaction.src_blocks[: compaction.num_kept_blocks]), budget)
    positions = torch.arange(compaction.first_position, compaction.first_position + chunk, device=src.device)
    sinks = spec.sinks if compaction.chunk_index == 0 else 0
    kept_by_layer = []
    for layer in layers if layers is not None else range(cache.spec.num_layers):
        k, v = cache.read_rows(layer, src.reshape(-1))  # [C, KVH, D], decoded
        kept = kept_indices(k.transpose(0, 1), v.transpose(0, 1), positions, spec, budget, sinks)
        rows = src.gather(0, kept.transpose(0, 1))  # [budget, KVH]: kept row i of head h
        move_rows(cache, layer, rows.reshape(-1), dst.reshape(-1))
        kept_by_layer.append(kept)
    return kept_by_layer


def move_rows(cache: PagedKVCache, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy flat rows `src` to `dst` of one layer as stored (data and parameters), every source read first."""
    for side in (cache.keys, cache.values):
        tensors = [side.data[layer]] + ([side.params[layer]] if side.params else [])
        for tensor in tensors:
            flat = tensor.view(-1, tensor.shape[-1])
            flat.index_copy_(0, dst, flat.index_select(0, src))


def kept_record(kept_by_layer: list[torch.Tensor]) -> torch.Tensor:
    """What the lab draws of one compacted chunk: `compact_chunk`'s kept indices as one small CPU array
    `[layers, KVH, budget]` of positions within the chunk (int16: a chunk is far under 32,768 tokens), a copy
    that later compactions never touch."""
    return torch.stack(kept_by_layer).to(device="cpu", dtype=torch.int16)
