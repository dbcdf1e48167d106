"""The `cpu` backend's attention for a packed layer (kv/cache/packing.py): a layer whose K/V are not the
pool's rows as they lie, Gemma 4's global layers (another head dim, fewer KV heads, K = V).

Such a layer cannot be read in place, so each step materializes the blocks its queries read, once per
stored layer (layers that read its cache reuse them): the pool's rows decoded to float32, unpacked to the
layer's own heads, and, for K = V, the keys derived from the values at each block's positions (the model's
`keys_from_values`), for new tokens and cached ones alike. Every query token is then one row of the C++
kernel over those blocks with its absolute positions, as a plain layer's rows are on a float cache: a
token's attention is the same bits however its request was cached, chunked or batched. Without the kernel,
each request's rows attend over its blocks in torch (kv/attention/reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels import ops
from kvserve.kv.attention.base import KeysFromValues
from kvserve.kv.attention.cpu_metadata import AttentionMetadata
from kvserve.kv.attention.reference import attend as reference_attend
from kvserve.kv.cache.packing import LayerKV, unpack_blocks
from kvserve.kv.cache.storage import PagedKVCache


@dataclass
class StepRows:
    """Every query row of a step in one KV group, as the C++ kernel reads them, with the pool's block ids:
    row i at `row_pos[i]` sees keys `row_low[i]..row_pos[i]`, block j of them at `tables[row_table[i] + j]`
    (-1 where a row never reads: before its window). `runs`: (first row, row count, table start) per request."""

    tables: list[int]
    row_table: list[int]
    row_low: list[int]
    row_pos: list[int]
    runs: list[tuple[int, int, int]]

    @staticmethod
    def of(meta: AttentionMetadata, block_size: int) -> StepRows:
        rows = StepRows([], [], [], [], [])
        if meta.decode is not None:
            d = meta.decode
            tables, row_table = d.tables.tolist(), d.row_table.tolist()
            rows.tables, rows.row_table = tables, row_table
            rows.row_low, rows.row_pos = d.row_low.tolist(), d.row_pos.tolist()
            first = 0
            for i in range(1, len(row_table) + 1):
                if i == len(row_table) or row_table[i] != row_table[first]:
                    rows.runs.append((first, i - first, row_table[first]))
                    first = i
        for p in meta.prefills:
            if p.query_start != len(rows.row_pos):
                raise ValueError("a step's prefill rows follow its decode rows in order")
            start = len(rows.tables)
            rows.tables.extend([-1] * (p.key_start // block_size) + p.block_ids.tolist())
            positions = p.positions.tolist()
            window = meta.sliding_window
            rows.runs.append((len(rows.row_pos), len(positions), start))
            rows.row_table.extend([start] * len(positions))
            rows.row_low.extend(max(0, pos - window + 1) if window else 0 for pos in positions)
            rows.row_pos.extend(positions)
        return rows


@dataclass
class MaterializedLayer:
    """One stored layer's blocks for a step, in its own heads: K and V `[U + 1, KVH, block_size, D]` float32
    (the last block zero, where rows never read), and the step's tables remapped to them."""

    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor


def materialize(cache: PagedKVCache, slots: list[tuple[int, StepRows]], rows_used: range, layer: LayerKV,
                keys_from_values: KeysFromValues | None) -> MaterializedLayer:
    """Read, unpack and (K = V) derive the keys of the blocks a step's rows read of the layer in `slots`: each
    slot with its KV group's rows (the tables of one window: the same entries, each group's own blocks), the
    layer's rows of each block `rows_used`."""
    block_size = cache.block_size
    step = slots[0][1]
    local: dict[int, int] = {}  # the first slot's block id -> materialized index
    entries: list[int] = []  # materialized index -> its entry in the tables (the same in every group's)
    block_index: list[int] = []  # materialized index -> the block's place in its table (its positions)
    remapped = [-1] * len(step.tables)
    for first, count, start in step.runs:
        low = min(step.row_low[first : first + count]) // block_size
        high = max(step.row_pos[first : first + count]) // block_size
        for j in range(low, high + 1):
            block = step.tables[start + j]
            if block < 0:
                raise ValueError(f"a query would read a freed block (table index {j})")
            if block not in local:
                local[block] = len(block_index)
                entries.append(start + j)
                block_index.append(j)
            elif block_index[local[block]] != j:
                raise ValueError(f"block {block} is read at two positions in one step")
            remapped[start + j] = local[block]
    dummy, device = len(block_index), cache.device
    tables = torch.tensor([dummy if index < 0 else index for index in remapped], dtype=torch.long, device=device)
    parts = []  # [U, rows, block_size, width] per slot, read at its own group's blocks
    for slot, rows in slots:
        if len(rows.tables) != len(step.tables):
            raise ValueError("a layer's slots have tables of different lengths")
        ids = torch.tensor([rows.tables[entry] for entry in entries], dtype=torch.long, device=cache.device)
        parts.append(cache.gather(slot, ids, torch.float32))
    mine = slice(rows_used.start, rows_used.stop)
    k, v = unpack_blocks(layer, cache.spec.head_dim, torch.cat([part.k[:, mine].float() for part in parts], dim=1),
                         torch.cat([part.v[:, mine].float() for part in parts], dim=1))
    if k is None:
        if keys_from_values is None:
            raise ValueError("a K = V layer attends with keys_from_values")
        count, heads, _, dim = v.shape
        positions = (torch.tensor(block_index, dtype=torch.long, device=device)[:, None] * block_size
                     + torch.arange(block_size, device=device)[None, :]).reshape(-1)
        tokens = v.permute(0, 2, 1, 3).reshape(count * block_size, heads, dim)
        k = keys_from_values(tokens, positions).reshape(count, block_size, heads, dim).permute(0, 2, 1, 3)
    zero = v.new_zeros(1, *v.shape[1:])
    return MaterializedLayer(torch.cat([k.float(), zero]).contiguous(), torch.cat([v, zero]).contiguous(), tables)


def attend_materialized(q: torch.Tensor, blocks: MaterializedLayer, step: StepRows, scale: float,
                        window: int | None, split_blocks: int, sinks: torch.Tensor | None,
                        use_kernel: bool) -> torch.Tensor:
    """Every row of `q` `[N, H, D]` over its blocks -> `[N, H * D]`."""
    if use_kernel:
        rows = ops.RowTables(blocks.tables, *(torch.tensor(values, dtype=torch.long)
                                              for values in (step.row_table, step.row_low, step.row_pos)))
        return ops.paged_decode(q.float().contiguous(), blocks.k, blocks.v, rows, scale, split_blocks, sinks)
    heads, dim = blocks.k.shape[1], blocks.k.shape[3]
    outputs = []
    for first, count, start in step.runs:
        end = step.row_pos[first + count - 1] + 1
        table = blocks.tables[start : start + (end - 1) // blocks.k.shape[2] + 1]
        keys = blocks.k[table].transpose(0, 1).reshape(heads, -1, dim)[:, :end]
        values = blocks.v[table].transpose(0, 1).reshape(heads, -1, dim)[:, :end]
        positions = torch.tensor(step.row_pos[first : first + count], dtype=torch.long, device=q.device)
        outputs.append(reference_attend(q[first : first + count].transpose(0, 1), keys, values, positions, scale,
                                        window, sinks=sinks))
    return torch.cat(outputs)
