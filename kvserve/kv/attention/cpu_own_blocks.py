"""A multi-token decode's rows over a pool with open blocks (kv/cache/open_blocks.py): the block its write fills.

A single-token decode below its block's last row reads that block open, in float16 (its rows so far); the
write that fills the block's last row encodes it. A request whose step computes k + 1 tokens (a verify of k
drafts, a run of forced tokens) writes them all before any of them attends, so where they fill their block,
its rows before the last one would read it encoded: numbers a decode of the same tokens one at a time never
sees (scales chosen over rows that came later, drafts among them). Those rows read their block as it was open
for them instead: the rows cached before the step and the step's new ones, in float16, beside the pool (the
C++ kernel's `own_blocks`), so k + 1 queries in one call give the bits of k + 1 single-token decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.attention.cpu_metadata import DecodeMetadata
from kvserve.kv.cache.quant import OPEN_BLOCK_DTYPE
from kvserve.kv.cache.storage import PagedKVCache


@dataclass
class OwnBlocksPlan:
    """One KV group's step: which decode rows read their own block beside the pool, and what fills it."""

    row_own: torch.Tensor  # [rows] the row's own block's index here, or -1 (the pool or an open slot)
    count: int  # own blocks
    before_rows: torch.Tensor  # the pool's flat rows cached before the step in those blocks (token-major)
    before_at: torch.Tensor  # where each lands in the own blocks' flat rows `[count * KVH * block_size]`
    new_tokens: torch.Tensor  # the decode rows (new tokens) written into those blocks
    new_at: torch.Tensor  # where each (token, KV head) lands, token-major


def plan_own_blocks(decode: DecodeMetadata, block_size: int, num_kv_heads: int) -> OwnBlocksPlan | None:
    """The plan for a step's decode rows, or None where no row's block is filled by the step's write below it."""
    tables, row_table, row_pos = decode.tables.tolist(), decode.row_table.tolist(), decode.row_pos.tolist()
    own = [tables[table + pos // block_size] for table, pos in zip(row_table, row_pos)]
    last = block_size - 1
    filled = {block for block, pos in zip(own, row_pos) if pos % block_size == last}
    index: dict[int, int] = {}  # own block -> its index among the step's own blocks
    row_own = [-1] * len(own)
    for row, (block, pos) in enumerate(zip(own, row_pos)):
        if block in filled and pos % block_size != last:
            row_own[row] = index.setdefault(block, len(index))
    if not index:
        return None
    first: dict[int, int] = {}  # own block -> the row within it of the step's first token there
    new_tokens, new_at = [], []
    for row, (block, pos) in enumerate(zip(own, row_pos)):
        if block in index:
            first[block] = min(first.get(block, block_size), pos % block_size)
            new_tokens.append(row)
            new_at.extend((index[block] * num_kv_heads + head) * block_size + pos % block_size
                          for head in range(num_kv_heads))
    before_rows, before_at = [], []
    for block, j in index.items():
        for r in range(first[block]):
            for head in range(num_kv_heads):
                before_rows.append((block * num_kv_heads + head) * block_size + r)
                before_at.append((j * num_kv_heads + head) * block_size + r)
    longs = [torch.tensor(x, dtype=torch.long, device=decode.tables.device)
             for x in (row_own, before_rows, before_at, new_tokens, new_at)]
    return OwnBlocksPlan(longs[0], len(index), *longs[1:])


def own_blocks(cache: PagedKVCache, layer: int, plan: OwnBlocksPlan, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's `own_blocks` for `layer` (K, V `[count, KVH, block_size, D]` float16, `row_own`), from the
    pool's rows, read before the step's write, and the step's new K/V `[N, KVH, D]`. Rows past the step's last
    token stay zero (attention reads hidden rows with a zero weight: 0 x NaN would be NaN)."""
    heads, dim = cache.spec.num_kv_heads, cache.spec.head_dim
    parts = []
    for new, old in zip((k, v), cache.read_rows(layer, plan.before_rows)):
        block = torch.zeros(plan.count * heads * cache.block_size, dim, dtype=OPEN_BLOCK_DTYPE, device=k.device)
        block.index_copy_(0, plan.before_at, old.reshape(-1, dim).to(OPEN_BLOCK_DTYPE))
        block.index_copy_(0, plan.new_at, new.index_select(0, plan.new_tokens).reshape(-1, dim).to(OPEN_BLOCK_DTYPE))
        parts.append(block.view(plan.count, heads, cache.block_size, dim))
    return parts[0], parts[1], plan.row_own
