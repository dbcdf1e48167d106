"""The `cpu` backend's step metadata: where new K/V go and which blocks each request reads.

A step's batch is a flat list of tokens from several requests, decode tokens
first (one per request: the backend's `is_decode` says which), then prefill
chunks. Every tensor is built on the cache's device. Metadata is built once per KV
group (kv/groups/layout.py), from each request's table in that group, and read by
every layer of the group. Only blocks inside a windowed group's window are
read; the positions before it may hold the null block (freed), and reading
one there would be a bug, so building the metadata refuses it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvserve.arith import cdiv
from kvserve.errors import KVIntegrityError
from kvserve.kernels import ops
from kvserve.kv.attention.base import SequenceSlice, single_token_decode
from kvserve.kv.groups.layout import first_needed_block


@dataclass
class DecodeMetadata:
    num_seqs: int  # query rows (one token each)
    # What the C++ kernel reads (kernels/csrc/decode_splits.h): row i at position row_pos[i] sees keys
    # row_low[i]..row_pos[i], block j of them at tables[row_table[i] + j]. O(rows + blocks) to build, where
    # the lists below are O(rows x blocks each): a prefill chunk's 2,048 rows would list ~400k blocks.
    tables: torch.Tensor  # the block tables of the rows' requests, one after another
    row_table: torch.Tensor  # [num_seqs]
    row_low: torch.Tensor  # [num_seqs]
    row_pos: torch.Tensor  # [num_seqs]
    # The torch kernels' lists (built only for them: `block_lists`).
    block_ids: torch.Tensor | None = None  # [NB] every valid block of every row, row by row
    seq_index: torch.Tensor | None = None  # [NB] which row each block belongs to
    key_valid: torch.Tensor | None = None  # [NB, block_size] which keys of each block the row may see
    seq_offsets: torch.Tensor | None = None  # [num_seqs + 1] row i's blocks are block_ids[seq_offsets[i]:...[i + 1]]
    # When requests share many blocks (a common prefix), attention runs over
    # the union of their blocks, each read once, with a per-request mask.
    union_block_ids: torch.Tensor | None = None  # [U]
    union_mask: torch.Tensor | None = None  # [num_seqs, U * block_size]

    def row_tables(self) -> ops.RowTables:
        """What the C++ kernels read of it."""
        return ops.RowTables(self.tables, self.row_table, self.row_low, self.row_pos)


# Use the union when the dense scores over it (num_seqs x U blocks) cost at most this many times the
# (request, block) pairs the torch split-KV path gathers. Never against the C++ kernel: since it runs on
# every thread it reads shared pairs in place faster than the union is computed even when 32 requests
# share 1,024 of their 1,040 tokens (bench/decode_attention.py: kernel 1.15 / 1.52 ms, union 1.64 / 1.71).
UNION_SHARING_FACTOR = 4


def _with_union(meta: DecodeMetadata, block_size: int, factor: float) -> DecodeMetadata:
    union, inverse = torch.unique(meta.block_ids, return_inverse=True)
    if union.numel() * meta.num_seqs > factor * meta.block_ids.numel():
        return meta  # little sharing: reading each request's blocks costs less
    mask = torch.zeros(meta.num_seqs, union.numel(), block_size, dtype=torch.bool, device=union.device)
    mask[meta.seq_index, inverse] = meta.key_valid
    meta.union_block_ids, meta.union_mask = union, mask.view(meta.num_seqs, -1)
    return meta


@dataclass
class PrefillMetadata:
    query_start: int  # rows of the step's token batch
    query_end: int
    block_ids: torch.Tensor  # the request's blocks covering keys key_start..seq_len-1
    seq_len: int
    positions: torch.Tensor
    key_start: int = 0  # position of the first key read: the window's first block's (0: full attention)


@dataclass
class AttentionMetadata:
    """One KV group's view of a step."""

    slot_blocks: torch.Tensor  # [N] block of each new token
    slot_rows: torch.Tensor  # [N] row within that block
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefills: list[PrefillMetadata] = field(default_factory=list)
    sliding_window: int | None = None  # this kind's window (None = full attention)
    # [N * KV heads] the flat cache rows of every new token's K/V heads, token-major (cpu.slot_indices'
    # order), where the builder was given the head count.
    slots: torch.Tensor | None = None


def _decode_rows(decodes: Sequence[tuple[Sequence[int], int, int]], block_size: int,
                 sliding_window: int | None) -> tuple[list[int], list[int], list[int], list[int]]:
    """What DecodeMetadata's kernel tensors hold, as lists: (tables, row_table, row_low, row_pos) for
    (block table, first query position, query count) runs, one row per query token, each reading only its
    own blocks inside its window. A run is a decode (count 1) or, where every token is attended as a row, a
    prefill chunk."""
    tables: list[int] = []
    row_table: list[int] = []
    row_low: list[int] = []
    row_pos: list[int] = []
    for table, start, count in decodes:
        needed = table[: (start + count - 1) // block_size + 1]
        lows = [max(0, p - sliding_window + 1) if sliding_window else 0 for p in range(start, start + count)]
        if min(needed[lows[0] // block_size :]) < 0:
            raise KVIntegrityError(f"a query at positions {start}..{start + count - 1} would read a freed block")
        row_table.extend([len(tables)] * count)
        tables.extend(needed)
        row_low.extend(lows)
        row_pos.extend(range(start, start + count))
    return tables, row_table, row_low, row_pos


def _with_block_lists(meta: DecodeMetadata, rows: tuple[list[int], list[int], list[int], list[int]],
                      block_size: int, union_factor: float | None, device: torch.device) -> DecodeMetadata:
    """`meta` (made from `rows`, `_decode_rows`' lists) with every row's blocks listed too (what the torch
    kernels read), and their union where `union_factor` says it pays."""
    tables, row_table, row_low, row_pos = rows
    dec_blocks: list[int] = []
    first_index: list[int] = []
    offsets = [0]
    for start, low, pos in zip(row_table, row_low, row_pos):
        dec_blocks.extend(tables[start + low // block_size : start + pos // block_size + 1])
        first_index.append(low // block_size)
        offsets.append(len(dec_blocks))
    offsets_t = torch.tensor(offsets, device=device)
    # output_size given: no read of the counts back from the device to size the result.
    seq_index = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), offsets_t[1:] - offsets_t[:-1],
                                        output_size=len(dec_blocks))
    block_index = (torch.arange(len(dec_blocks), device=device) - offsets_t[seq_index]
                   + torch.tensor(first_index, device=device)[seq_index])
    key_pos = (block_index * block_size)[:, None] + torch.arange(block_size, device=device)[None, :]
    meta.key_valid = ((key_pos <= meta.row_pos[seq_index, None]) & (key_pos >= meta.row_low[seq_index, None]))
    meta.block_ids, meta.seq_index, meta.seq_offsets = torch.tensor(dec_blocks, device=device), seq_index, offsets_t
    return _with_union(meta, block_size, union_factor) if union_factor is not None else meta


def build_attention_metadata(
    slices: Sequence[SequenceSlice], block_size: int, sliding_window: int | None = None, group: int = 0,
    union_factor: float | None = UNION_SHARING_FACTOR, is_decode: Callable[[int], bool] = single_token_decode,
    device: str | torch.device = "cpu", tokens_as_rows: bool = False, block_lists: bool = True,
    num_kv_heads: int | None = None,
) -> AttentionMetadata:
    """Metadata of KV group `group` (window `sliding_window`, None = full) for a step whose token batch
    is `slices` in order, its tensors on `device` (the cache's). `union_factor` decides when decodes
    sharing blocks attend over their union (see UNION_SHARING_FACTOR); None never builds it.

    Slices that `is_decode` (the backend's rule) before the first other one are decodes (the batch
    order puts them there); any later one is attended as a prefill chunk. With `tokens_as_rows` every
    token of every slice is a row of the decode metadata instead (no prefill chunks): one kernel attends
    each query alone, so its result does not depend on how its request was chunked or batched.
    `block_lists=False`: the decode metadata holds only what the C++ kernel reads. `num_kv_heads`: the
    metadata also holds the new tokens' flat cache rows (`slots`), made here as integers with the rest.
    """
    device = torch.device(device)
    slot_blocks: list[int] = []
    slot_rows: list[int] = []
    decodes: list[tuple[Sequence[int], int, int]] = []  # (block table, first query position, query count)
    prefills: list[PrefillMetadata] = []
    row = 0
    for s in slices:
        table = s.block_tables[group]
        # In the group's slots: a compressing request's full-attention tables no longer hold the tokens its
        # compressed chunks dropped (kv/compressed_chunks.py); RoPE uses positions, the model's business.
        start = s.num_computed_tokens - (s.slot_offsets[group] if s.slot_offsets else 0)
        end = start + s.num_new_tokens
        if len(table) * block_size < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        for position in range(start, end):
            slot_blocks.append(table[position // block_size])
            slot_rows.append(position % block_size)
        if tokens_as_rows or (is_decode(s.num_new_tokens) and not prefills):
            if not tokens_as_rows and s.num_new_tokens != 1:  # a multi-token decode comes as single-token slices
                raise ValueError(f"the cpu decode kernels take one query token per request, not {s.num_new_tokens}")
            if decodes and decodes[-1][0] is table and sum(decodes[-1][1:]) == start:
                # The next token of the run before (a verify's or forced tokens' queries, one slice each): one
                # run of rows sharing the request's table, which the kernel attends in tiles.
                decodes[-1] = (table, decodes[-1][1], decodes[-1][2] + s.num_new_tokens)
            else:
                decodes.append((table, start, s.num_new_tokens))
        else:
            first = first_needed_block(sliding_window, start, block_size)
            read = list(table[first : cdiv(end, block_size)])
            if read and min(read) < 0:
                raise KVIntegrityError(f"a prefill chunk at positions {start}..{end - 1} would read a freed block")
            prefills.append(PrefillMetadata(row, row + s.num_new_tokens,
                                            torch.tensor(read, dtype=torch.long, device=device), end,
                                            torch.arange(start, end, device=device), first * block_size))
        row += s.num_new_tokens
    if slot_blocks and min(slot_blocks) < 0:
        raise KVIntegrityError("a new token's block is the null block")
    # Every list goes to the device in one tensor, split into views: a decode step's Python runs with caches
    # the weights just flushed, where each tensor made costs tens of microseconds.
    decode_lists = _decode_rows(decodes, block_size, sliding_window) if decodes else ()
    # A decode step's few slots as Python integers cost less than the five tensor ops of cpu.slot_indices.
    slots = [] if num_kv_heads is None else [(block * num_kv_heads + head) * block_size + row
                                             for block, row in zip(slot_blocks, slot_rows)
                                             for head in range(num_kv_heads)]
    lists = [slot_blocks, slot_rows, slots, *decode_lists]
    parts = torch.tensor(list(itertools.chain(*lists)), dtype=torch.long, device=device).split(
        [len(values) for values in lists])
    decode = None
    if decodes:
        decode = DecodeMetadata(len(decode_lists[3]), *parts[3:])
        if block_lists:
            decode = _with_block_lists(decode, decode_lists, block_size, union_factor, device)
    return AttentionMetadata(parts[0], parts[1], sum(d[2] for d in decodes), decode, prefills, sliding_window,
                             None if num_kv_heads is None else parts[2])
