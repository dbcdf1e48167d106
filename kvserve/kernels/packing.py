"""Group-quantized weights and the packed layout the C++ quantized matmul reads (csrc/quant_matmul.cpp).

A weight `[rows, cols]` is held as unsigned codes in groups of 32 inputs,
w = scale * code + offset per (row, group), scale and offset in fp16. That is
exactly what a GGUF Q4_0 (offset -8d), Q4_1 (offset m), Q5_0 (-16d), Q5_1 and
Q8_0 (offset -128d) block holds, so those load without re-quantizing; fp32
weights are quantized here (asymmetric, round to nearest). The packed layout
interleaves 16 rows so that one 64-byte load carries four consecutive inputs
of each of them (see the C++ file); it is the same for every instruction set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SIZE = 32  # inputs per group: the GGUF Q4/Q5/Q8 block
TILE_ROWS = 16  # output rows interleaved in one packed tile
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class GroupCodes:
    """Weights as codes: w[r, c] = scales[r, c // 32] * level[r, c] + offsets[r, c // 32], the level being the
    code itself, or `table[code]` for 4-bit codes of a format whose 16 levels are not evenly spaced (MXFP4)."""

    codes: torch.Tensor  # uint8 [rows, cols], below 2**bits
    scales: torch.Tensor  # float16 [rows, cols // 32]
    offsets: torch.Tensor  # float16 [rows, cols // 32]
    bits: int  # 4 or 8: the packed width (5-bit GGUF codes travel as 8-bit)
    table: torch.Tensor | None = None  # uint8 [16], values below 128: the level of each 4-bit code

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def levels(self) -> torch.Tensor:
        """uint8 [rows, cols]: what each code stands for (the codes themselves without a table)."""
        return self.codes if self.table is None else self.table[self.codes.long()]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these codes stand for."""
        rows, cols = self.codes.shape
        grouped = self.levels().view(rows, cols // GROUP_SIZE, GROUP_SIZE).float()
        return (grouped * self.scales.float()[..., None] + self.offsets.float()[..., None]).view(rows, cols)

    def select_rows(self, index: torch.Tensor) -> GroupCodes:
        return GroupCodes(self.codes[index], self.scales[index], self.offsets[index], self.bits, self.table)

    def untabled(self) -> GroupCodes:
        """The same weights with their levels as 8-bit codes (exact: every level is below 128)."""
        if self.table is None:
            return self
        return GroupCodes(self.levels(), self.scales, self.offsets, 8)

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        """Row blocks stacked (the shards of a fused projection), at the widest width among them; parts of one
        table keep it, mixed ones hold their levels as 8-bit codes."""
        table = parts[0].table
        if table is None or any(p.table is None or not torch.equal(p.table, table) for p in parts):
            parts, table = [p.untabled() for p in parts], None
        bits = max(p.bits for p in parts)
        return GroupCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.offsets for p in parts]), bits, table)


def fits_fp16(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all()) and float(values.abs().max()) <= _FP16_MAX


def quantize_groups(weight: torch.Tensor, bits: int) -> GroupCodes:
    """fp32 `[rows, cols]` (cols a multiple of 32) -> codes: per group, offset = min, scale = (max - min) /
    (2**bits - 1), both rounded to fp16 first so that the codes are chosen against what is held."""
    rows, cols = weight.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"group-quantized weights need input sizes divisible by {GROUP_SIZE}; this one has {cols}")
    if not fits_fp16(weight):
        raise ValueError("weights beyond fp16's range cannot be held with fp16 group scales")
    levels = 2**bits - 1
    groups = weight.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
    offsets = groups.amin(dim=-1).half()
    span = groups.amax(dim=-1) - offsets.float()
    # A constant group has span 0: any scale then gives codes 0 (the offset is the value).
    scales = (span / levels).clamp_min(2**-24).half()
    codes = torch.round((groups - offsets.float()[..., None]) / scales.float()[..., None]).clamp(0, levels)
    return GroupCodes(codes.to(torch.uint8).view(rows, cols), scales, offsets, bits)


def zero_point(weights: GroupCodes) -> int | None:
    """The integer z (0..255) with every group's offset exactly -z * its scale (GGUF Q4_0: 8, Q5_0: 16, Q8_0:
    128; MXFP4's shifted levels: 12), which the kernel folds into its integer dot products; None where the
    offsets are free (Q4_1, Q5_1, weights quantized here). Groups of scale 0 and offset 0 fit any z."""
    scales, offsets = weights.scales.float(), weights.offsets.float()
    nonzero = scales != 0
    if not bool(nonzero.any()):
        return 0 if not bool(offsets.any()) else None
    ratio = -float(offsets[nonzero][0]) / float(scales[nonzero][0])
    zero = round(ratio)
    # An fp16 scale times an 8-bit integer is exact in fp32, so the comparison is exact too.
    if zero != ratio or not 0 <= zero <= 255 or not torch.equal(offsets, -zero * scales):
        return None
    return zero


def block_bytes(bits: int, offsets: bool = True) -> int:
    """Bytes of one packed (tile, group): the codes of 16 rows x 32 inputs, then 16 fp16 scales and (unless
    the codes have a zero point, which stands for them) 16 fp16 offsets."""
    return bits * TILE_ROWS * GROUP_SIZE // 8 + (2 if offsets else 1) * TILE_ROWS * 2


def packed_bytes(rows: int, cols: int, bits: int, offsets: bool = True) -> int:
    """Bytes `pack` makes of a `rows` x `cols` weight (rows padded to whole tiles)."""
    return -(-rows // TILE_ROWS) * (cols // GROUP_SIZE) * block_bytes(bits, offsets)


def pack(weights: GroupCodes, offsets: bool = True) -> torch.Tensor:
    """GroupCodes -> uint8 `[tiles, groups, block_bytes]`, the layout csrc/quant_matmul.cpp reads (a table's
    4-bit codes as they are: the kernel takes the table beside them). `offsets=False` leaves the offsets out,
    for codes with a zero point (`zero_point`), which the kernel is then given instead: a Q4_0 block's 18
    bytes per 32 weights, as the file holds it, where the offsets would make 20."""
    rows, cols = weights.shape
    tiles, groups = -(-rows // TILE_ROWS), cols // GROUP_SIZE
    pad = tiles * TILE_ROWS - rows
    # [tile, group, row in tile, input in group]
    codes = F.pad(weights.codes, (0, 0, 0, pad)).view(tiles, TILE_ROWS, groups, GROUP_SIZE).transpose(1, 2)
    if weights.bits == 4:
        # vector j holds inputs 4j..4j+3 (low nibbles) and 16+4j.. (high nibbles) of every row
        low = codes[..., :16].reshape(tiles, groups, TILE_ROWS, 4, 4)
        high = codes[..., 16:].reshape(tiles, groups, TILE_ROWS, 4, 4)
        vectors = (low | (high << 4)).permute(0, 1, 3, 2, 4)
    elif weights.bits == 8:
        vectors = codes.reshape(tiles, groups, TILE_ROWS, 8, 4).permute(0, 1, 3, 2, 4)
    else:
        raise ValueError(f"packed weights are 4 or 8 bits, not {weights.bits}")

    def per_tile(values: torch.Tensor) -> torch.Tensor:  # [rows, groups] fp16 -> [tiles, groups, 32] bytes
        padded = F.pad(values, (0, 0, 0, pad)).view(tiles, TILE_ROWS, groups).transpose(1, 2).contiguous()
        return padded.view(torch.uint8)

    parts = [vectors.reshape(tiles, groups, -1), per_tile(weights.scales)]
    if offsets:
        parts.append(per_tile(weights.offsets))
    return torch.cat(parts, dim=-1).contiguous()
