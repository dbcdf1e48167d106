"""Layers whose K/V differ in shape, laid out in one pool of uniform rows (Gemma 4).

The pool is made of *slots* (what the rest of the cache calls its layers): each keeps, per token, `rows`
rows of `width` elements on each side (K and V), so the pool, its pages, codecs, prefix cache, tiers and
planner all see one geometry (KVSpec.num_kv_heads = rows, KVSpec.head_dim = width). A slot holds exactly the
most common kind of layer: such a layer (KV heads = rows, head dim = width, K and V both stored) is *plain*,
its rows are its heads and the attention kernels read it in place. Any other layer is *packed* over
consecutive slots: its K elements (KV heads x head dim, head-major) fill the rows of the K side, slot after
slot, and its V elements those of the V side; a K = V layer keeps V alone, its elements filling the K side's
rows first and the V side's after. Gemma 4 E2B's global layers (one KV head of 512, beside sliding layers of
one of 256) span two slots; rows a layer leaves empty are padding (KVSpec reports them): none for E2B/E4B.

Pages stay uniform, so one free queue serves every layer kind, as vLLM's hybrid allocator unifies page
sizes; the alternative, one pool per shape, would split the budget between shapes in advance and strand
whichever a workload needs less of.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from kvserve.arith import cdiv


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One stored layer's own K/V shape."""

    num_kv_heads: int
    head_dim: int
    k_eq_v: bool = False  # V alone is stored; keys are derived from it (kv/attention/base.py KeysFromValues)

    @property
    def elements(self) -> int:
        """Elements of one token's K (or V) of this layer."""
        return self.num_kv_heads * self.head_dim


def side_rows(layer: LayerKV, width: int) -> tuple[int, int]:
    """Rows of `width` that `layer` fills per token on the K side and on the V side."""
    total = layer.elements // width
    if layer.k_eq_v:
        return cdiv(total, 2), total - cdiv(total, 2)
    return total, total


def row_geometry(layers: Sequence[LayerKV]) -> tuple[int, int]:
    """(rows per side of a slot, row width) of a pool holding `layers`: the width divides every head dim; a
    slot holds exactly the most common kind of layer, so those are plain (read in place by the kernels)."""
    width = math.gcd(*(layer.head_dim for layer in layers))
    needs = Counter(max(side_rows(layer, width)) for layer in layers)
    rows = min(needs, key=lambda need: (-needs[need], need))  # the commonest; of equals, the least padding
    return rows, width


def slots_needed(layer: LayerKV, rows: int, width: int) -> int:
    """Slots of `rows` rows per side that `layer` spans (a larger layer takes several, a smaller one pads)."""
    return cdiv(max(side_rows(layer, width)), rows)


def rows_used(layer: LayerKV, rows: int, width: int) -> int:
    """Rows per side `layer` takes in each of its slots: every row of a slot it spans, else its own need (the
    same on both sides, so one flat row index serves K and V)."""
    return rows if slots_needed(layer, rows, width) > 1 else max(side_rows(layer, width))


def place_layers(layers: Sequence[LayerKV], windows: Sequence[int | None], rows: int, width: int,
                 share_slots: bool) -> tuple[list[tuple[int, int]], list[int | None]]:
    """Each layer's (first slot, row offset in it) and each slot's window. A layer larger than a slot spans new
    ones; smaller layers of one window share a slot, first fit (`share_slots`: not under a blockwise codec,
    whose open blocks are written a token's rows at once), so Gemma 4 31B's K = V global layers (4 rows of the
    16 of a sliding layer's slot) fill a slot four at a time."""
    placements: list[tuple[int, int]] = []
    slot_windows: list[int | None] = []
    free: dict[int, int] = {}  # a shared slot -> its rows still free
    for layer, window in zip(layers, windows):
        need = rows_used(layer, rows, width)
        slot = next((s for s, left in free.items() if left >= need and slot_windows[s] == window), None)
        if share_slots and need < rows and slot is not None:
            placements.append((slot, rows - free[slot]))
            free[slot] -= need
            continue
        placements.append((len(slot_windows), 0))
        if share_slots and need < rows:
            free[len(slot_windows)] = rows - need
        slot_windows += [window] * slots_needed(layer, rows, width)
    return placements, slot_windows


def is_plain(layer: LayerKV, rows: int, width: int) -> bool:
    """Whether `layer`'s rows are its heads (the attention kernels read it in place)."""
    return not layer.k_eq_v and layer.num_kv_heads == rows and layer.head_dim == width


def pack_tokens(layer: LayerKV, rows: int, width: int, k: torch.Tensor | None,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens' K and V `[T, KVH, D]` of `layer` (k None for K = V) -> the pool's rows `[T, rows, width]`
    for each side, unfilled rows zero."""
    num_tokens = v.shape[0]
    k_rows, v_rows = side_rows(layer, width)
    sides = [v.new_zeros(num_tokens, rows, width), v.new_zeros(num_tokens, rows, width)]
    if layer.k_eq_v:
        flat = v.reshape(num_tokens, k_rows + v_rows, width)
        sides[0][:, :k_rows], sides[1][:, :v_rows] = flat[:, :k_rows], flat[:, k_rows:]
    else:
        sides[0][:, :k_rows] = k.reshape(num_tokens, k_rows, width)
        sides[1][:, :v_rows] = v.reshape(num_tokens, v_rows, width)
    return sides[0], sides[1]


def unpack_tokens(layer: LayerKV, width: int, k_rows: torch.Tensor,
                  v_rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The pool's rows `[T, rows, width]` of each side -> `layer`'s K (None for K = V) and V `[T, KVH, D]`."""
    num_tokens = k_rows.shape[0]
    nk, nv = side_rows(layer, width)
    shape = (num_tokens, layer.num_kv_heads, layer.head_dim)
    if layer.k_eq_v:
        return None, torch.cat([k_rows[:, :nk], v_rows[:, :nv]], dim=1).reshape(shape)
    return k_rows[:, :nk].reshape(shape), v_rows[:, :nv].reshape(shape)


def unpack_blocks(layer: LayerKV, width: int, k_blocks: torch.Tensor,
                  v_blocks: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Whole blocks `[NB, rows, block_size, width]` of each side -> `layer`'s K (None for K = V) and V
    `[NB, KVH, block_size, D]`, contiguous."""
    num_blocks, _, block_size, _ = k_blocks.shape
    nk, nv = side_rows(layer, width)

    def heads(x: torch.Tensor) -> torch.Tensor:  # [NB, r, bs, W] -> [NB, KVH, bs, D]
        per_token = x.permute(0, 2, 1, 3).reshape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        return per_token.permute(0, 2, 1, 3).contiguous()

    if layer.k_eq_v:
        return None, heads(torch.cat([k_blocks[:, :nk], v_blocks[:, :nv]], dim=1))
    return heads(k_blocks[:, :nk]), heads(v_blocks[:, :nv])
