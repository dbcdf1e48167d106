"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) as the file holds them, and the packed layout the C++ K-quant
matmul reads (csrc/kquant_matmul.cpp).

A K-quant row is a run of super-blocks of 256 inputs (ggml-quants.c's block_q4_K / q5_K / q6_K):
  Q4_K, Q5_K: w = d * sc[j] * q - dmin * mn[j], sub-block j of 32 inputs, q of 4 / 5 bits, sc, mn 6 bits
  Q6_K:       w = d * sc[j] * (q - 32), sub-block j of 16 inputs, q of 6 bits, sc a signed byte
`kquant_fields` unpacks a block into those codes and scales (gguf_quants dequantizes with it too) and
`pack_kquant` lays them out for the kernel: every code, scale, min, d and dmin kept exactly, 16 output
rows interleaved per tile so that one 64-byte load holds four inputs of each (see the C++ file). The
C++ repack (csrc/kquant_repack.cpp) does it in one pass where the kernels are built; `pack_kquant_reference`,
whole-matrix torch ops, is what the tests hold it to (a 1B-class file: ~0.5 s against ~15 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvserve.kernels import ops

SUPER_BLOCK = 256  # inputs per K-quant super-block
TILE_ROWS = 16  # output rows interleaved in one packed tile
KQUANT_KINDS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # the C++ kernel's kind numbers
ACTIVATION_BLOCK = 128  # inputs per int8 activation scale in the kernel (csrc/kquant_activations.h)
TYPE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes of one super-block in the file
_LOW_BYTES = 8 * 4 * 64  # the low nibbles of 16 rows x 256 inputs
_HIGH_BYTES = {"Q4_K": 0, "Q5_K": 512, "Q6_K": 1024}
_PARAM_BYTES = {"Q4_K": 320, "Q5_K": 320, "Q6_K": 288}


@dataclass
class KQuantCodes:
    """A matrix of K-quant super-blocks exactly as the file holds them: `blocks` uint8 `[rows, cols // 256,
    type bytes]`."""

    kind: str  # "Q4_K", "Q5_K" or "Q6_K"
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * SUPER_BLOCK

    def select_rows(self, index: torch.Tensor) -> KQuantCodes:
        return KQuantCodes(self.kind, self.blocks[index])

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these super-blocks stand for."""
        rows = self.blocks.shape[0]
        return dequantize_kquant(self.kind, self.blocks.reshape(-1, TYPE_BYTES[self.kind])).view(rows, -1)


class KQuantFields(NamedTuple):
    """The values of n super-blocks: w = d * sc * q - dmin * mn (Q4_K, Q5_K) or d * sc * (q - 32) (Q6_K)."""

    codes: torch.Tensor  # uint8 [n, 256], input order
    d: torch.Tensor  # float16 [n]
    dmin: torch.Tensor | None  # float16 [n]; None for Q6_K
    scales: torch.Tensor  # uint8 [n, 8] (6-bit) or int8 [n, 16] (Q6_K), one per sub-block
    mins: torch.Tensor | None  # uint8 [n, 8] (6-bit); None for Q6_K


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16)[:, 0]


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte field of Q4_K / Q5_K -> 8 six-bit scales and 8 six-bit mins (uint8)."""
    s = packed
    scales = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return scales, mins


def _low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 256]: sub-block 2i is chunk i's low nibbles, 2i+1 its high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, SUPER_BLOCK)


def kquant_fields(kind: str, blocks: torch.Tensor) -> KQuantFields:
    """Unpack `[n, type bytes]` uint8 super-blocks of `kind` (ggml-quants.c's layouts)."""
    if kind == "Q6_K":
        n = blocks.shape[0]
        ql = blocks[:, 0:128].reshape(n, 2, 2, 32)  # [half, ql[l] / ql[l+32], l]
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        # Within each 128-input half, four 32-input groups: low nibbles of ql[l], ql[l+32], then their high
        # nibbles; the 2 high bits are bit pairs 0, 1, 2, 3 of qh[l].
        low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [n, 2, 4, 32]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        codes = (low | (((qh >> shifts) & 3) << 4)).reshape(n, SUPER_BLOCK)
        scales = blocks[:, 192:208].contiguous().view(torch.int8)
        return KQuantFields(codes, _f16(blocks, 208), None, scales, None)
    scales, mins = _scales_mins(blocks[:, 4:16])
    if kind == "Q4_K":
        codes = _low_nibbles(blocks[:, 16:144])
    elif kind == "Q5_K":
        qh = blocks[:, 16:48]  # bit i of qh[l] is the 5th bit of input l of sub-block i
        shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        high = ((qh.unsqueeze(1) >> shifts) & 1) << 4  # [n, 8, 32]
        codes = _low_nibbles(blocks[:, 48:176]) | high.reshape(-1, SUPER_BLOCK)
    else:
        raise ValueError(f"not a K-quant type: {kind}")
    return KQuantFields(codes, _f16(blocks, 0), _f16(blocks, 2), scales, mins)


def dequantize_kquant(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """`[n, type bytes]` uint8 super-blocks of `kind` -> their fp32 values `[n, 256]` (as ggml computes them:
    d * sc first, then times the code, less dmin * mn)."""
    f = kquant_fields(kind, blocks)
    d = f.d.float()[:, None, None]
    if f.dmin is None:  # Q6_K: 16 sub-blocks of 16, codes offset by 32
        q = f.codes.float().view(-1, 16, 16) - 32.0
        return (d * f.scales.float()[..., None] * q).reshape(-1, SUPER_BLOCK)
    q = f.codes.float().view(-1, 8, 32)
    out = d * f.scales.float()[..., None] * q - f.dmin.float()[:, None, None] * f.mins.float()[..., None]
    return out.reshape(-1, SUPER_BLOCK)


def kquant_block_bytes(kind: str) -> int:
    """Bytes of one packed (tile, super-block): 16 rows' codes and their parameters."""
    return _LOW_BYTES + _HIGH_BYTES[kind] + _PARAM_BYTES[kind]


def kquant_packed_bytes(rows: int, cols: int, kind: str) -> int:
    """Bytes `pack_kquant` makes of a `rows` x `cols` matrix (rows padded to whole tiles)."""
    return -(-rows // TILE_ROWS) * (cols // SUPER_BLOCK) * kquant_block_bytes(kind)


def _tiled(values: torch.Tensor, tiles: int) -> torch.Tensor:
    """[rows, supers, ...] -> [tiles, supers, 16, ...] (rows padded with zeros to whole tiles)."""
    rows = values.shape[0]
    padded = F.pad(values, (0, 0) * (values.dim() - 1) + (0, tiles * TILE_ROWS - rows))
    return padded.view(tiles, TILE_ROWS, *values.shape[1:]).transpose(1, 2)


def _bytes(values: torch.Tensor, tiles: int, supers: int) -> torch.Tensor:
    return values.contiguous().view(torch.uint8).reshape(tiles, supers, -1)


def pack_kquant(matrix: KQuantCodes) -> torch.Tensor:
    """KQuantCodes -> uint8 `[tiles, supers, kquant_block_bytes]`, the layout csrc/kquant_matmul.cpp reads: by
    the C++ repack, or without the kernels by the torch reference (whose bytes are the same)."""
    packed = ops.kquant_repack(matrix.blocks, KQUANT_KINDS[matrix.kind])
    return pack_kquant_reference(matrix) if packed is None else packed


def pack_kquant_reference(matrix: KQuantCodes) -> torch.Tensor:
    """`pack_kquant` in whole-matrix torch ops: the layout spelled out, and the C++ repack's reference."""
    rows, supers = matrix.blocks.shape[:2]
    tiles = -(-rows // TILE_ROWS)
    fields = kquant_fields(matrix.kind, matrix.blocks.reshape(rows * supers, -1))
    # codes [tile, super, row in tile, group, 32 inputs]
    codes = _tiled(fields.codes.view(rows, supers, 8, 32), tiles)
    split = codes.reshape(tiles, supers, TILE_ROWS, 8, 2, 4, 4)  # [.., r, g, half, j, i]
    low = (split[..., 0, :, :] & 0x0F) | ((split[..., 1, :, :] & 0x0F) << 4)  # [t, s, r, g, j, i]
    groups = [low.permute(0, 1, 3, 4, 2, 5).reshape(tiles, supers, 8, -1)]  # [t, s, g, (j, r, i)]
    if matrix.kind == "Q5_K":
        bit = ((codes >> 4) & 1).reshape(tiles, supers, TILE_ROWS, 8, 8, 4)  # [.., r, g, k, i]: input 4k + i
        weights = (1 << torch.arange(8, dtype=torch.uint8)).view(8, 1)
        plane = (bit * weights).sum(dim=4, dtype=torch.uint8)  # [t, s, r, g, i]
        groups.append(plane.permute(0, 1, 3, 2, 4).reshape(tiles, supers, 8, -1))
    elif matrix.kind == "Q6_K":
        pair = ((codes >> 4) & 3).reshape(tiles, supers, TILE_ROWS, 8, 2, 4, 4)  # [.., r, g, h, j, i]
        weights = (1 << (2 * torch.arange(4, dtype=torch.uint8))).view(4, 1)
        plane = (pair * weights).sum(dim=5, dtype=torch.uint8)  # [t, s, r, g, h, i]
        groups.append(plane.permute(0, 1, 3, 4, 2, 5).reshape(tiles, supers, 8, -1))
    # Each group's low nibbles, then its high bits (one run of bytes a group); the groups in pairs, each pair
    # its scales (and mins), 64 bytes, then its codes; d (and dmin) first.
    codes_of_pairs = _bytes(torch.cat(groups, dim=3), tiles, supers).view(tiles, supers, 4, -1)
    per_block = (rows, supers)
    header = [_bytes(_tiled(fields.d.view(per_block), tiles), tiles, supers)]
    if matrix.kind == "Q6_K":
        scales = _tiled(fields.scales.view(*per_block, 16), tiles)  # [t, s, r, sub]
        params_of_pairs = _bytes(scales.transpose(2, 3), tiles, supers).view(tiles, supers, 4, 64)
    else:
        header.append(_bytes(_tiled(fields.dmin.view(per_block), tiles), tiles, supers))
        scales, mins = (_bytes(_tiled(values.view(*per_block, 8), tiles).transpose(2, 3), tiles, supers)
                        .view(tiles, supers, 4, 32) for values in (fields.scales, fields.mins))
        params_of_pairs = torch.cat([scales, mins], dim=3)
    parts = [*header, torch.cat([params_of_pairs, codes_of_pairs], dim=3).reshape(tiles, supers, -1)]
    packed = torch.cat(parts, dim=2)
    if packed.shape[2] != kquant_block_bytes(matrix.kind):  # a layout bug, never bad input
        raise RuntimeError(f"{matrix.kind} repacked to {packed.shape[2]} bytes a super-block, not "
                           f"{kquant_block_bytes(matrix.kind)}")
    return packed
