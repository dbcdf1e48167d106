"""Layers whose K/V differ in shape, laid out in one pool of uniform rows (Gemma 4).

Every stored layer of a pool keeps, per token, `rows` rows of `width` elements on each side (K and V):
the pool, its pages, codecs, prefix cache, tiers and planner all see that one geometry (KVSpec.num_kv_heads
= rows, KVSpec.head_dim = width). A layer whose own shape is exactly that (KV heads = rows, head dim =
width, K and V both stored) is *plain*: its rows are its heads and the attention kernels read it as any
layer. Any other layer is *packed*: its K elements (KV heads x head dim, head-major) fill the first rows of
the K side and its V elements those of the V side; a K = V layer keeps V alone, its elements filling the K
side's rows first and the V side's after, so Gemma 4's global layers (one KV head of 512 beside sliding
layers' one of 256 for K and one for V) fill a page exactly as the sliding layers do. Rows a layer does not
fill are padding: the bytes a uniform page costs a layer smaller than the largest (KVSpec reports them).

Pages stay uniform, so one free queue serves every layer kind, as vLLM's hybrid allocator unifies page
sizes; the alternative, one pool per shape, would split the budget between shapes in advance and strand
whichever a workload needs less of.
"""

from __future__ import annotations

import math
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


def row_geometry(layers: Sequence[LayerKV]) -> tuple[int, int]:
    """(rows per side, row width) of a pool holding `layers`: the width divides every head dim; the rows
    hold the largest layer (a K = V layer's V spread over both sides)."""
    width = math.gcd(*(layer.head_dim for layer in layers))
    rows = max(cdiv(layer.elements // width, 2) if layer.k_eq_v else layer.elements // width for layer in layers)
    return rows, width


def is_plain(layer: LayerKV, rows: int, width: int) -> bool:
    """Whether `layer`'s rows are its heads (the attention kernels read it in place)."""
    return not layer.k_eq_v and layer.num_kv_heads == rows and layer.head_dim == width


def _side_rows(layer: LayerKV, width: int) -> tuple[int, int]:
    """Rows `layer` fills on the K side and on the V side."""
    total = layer.elements // width
    if layer.k_eq_v:
        return cdiv(total, 2), total - cdiv(total, 2)
    return total, total


def pack_tokens(layer: LayerKV, rows: int, width: int, k: torch.Tensor | None,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens' K and V `[T, KVH, D]` of `layer` (k None for K = V) -> the pool's rows `[T, rows, width]`
    for each side, unfilled rows zero."""
    num_tokens = v.shape[0]
    k_rows, v_rows = _side_rows(layer, width)
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
    nk, nv = _side_rows(layer, width)
    shape = (num_tokens, layer.num_kv_heads, layer.head_dim)
    if layer.k_eq_v:
        return None, torch.cat([k_rows[:, :nk], v_rows[:, :nv]], dim=1).reshape(shape)
    return k_rows[:, :nk].reshape(shape), v_rows[:, :nv].reshape(shape)


def unpack_blocks(layer: LayerKV, width: int, k_blocks: torch.Tensor,
                  v_blocks: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Whole blocks `[NB, rows, block_size, width]` of each side -> `layer`'s K (None for K = V) and V
    `[NB, KVH, block_size, D]`, contiguous."""
    num_blocks, _, block_size, _ = k_blocks.shape
    nk, nv = _side_rows(layer, width)

    def heads(x: torch.Tensor) -> torch.Tensor:  # [NB, r, bs, W] -> [NB, KVH, bs, D]
        per_token = x.permute(0, 2, 1, 3).reshape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        return per_token.permute(0, 2, 1, 3).contiguous()

    if layer.k_eq_v:
        return None, heads(torch.cat([k_blocks[:, :nk], v_blocks[:, :nv]], dim=1))
    return heads(k_blocks[:, :nk]), heads(v_blocks[:, :nv])
