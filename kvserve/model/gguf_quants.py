"""GGML tensor types -> float32 torch tensors.

Each function takes the raw bytes of a tensor viewed as `[num_blocks, block_bytes]`
uint8 and returns `[num_blocks, block_elements]` float32. The layouts follow
ggml's `ggml-quants.c` (block structs and `dequantize_row_*`); everything is
vectorized over blocks so a 100M-parameter file dequantizes in about a second.

Tests check every type against the `gguf` package's independent numpy
implementation.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Callable

import numpy as np
import torch

from kvserve.errors import UnsupportedModelError
from kvserve.kernels.kquant_packing import KQUANT_KINDS, SUPER_BLOCK, TYPE_BYTES, KQuantCodes, dequantize_kquant
from kvserve.kernels.packing import GroupCodes, fits_fp16

QK_K = SUPER_BLOCK  # super-block size of the K-quants


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte offset `start` of every block, as a [n, 1] float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[n, 4] bytes holding a little-endian uint32 -> [n, count] of its low `count` bits."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [n, 4, 8], bit i of byte b at [b, i]
    return bits.reshape(packed.shape[0], 32)[:, :count]


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).float() - 8.0
    return d * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:20]).float() + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    high = _bits(blocks[:, 2:6], 32) << 4  # bit j is the 5th bit of element j
    q = (_nibbles(blocks[:, 6:22]) | high).float() - 16.0
    return d * q


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    high = _bits(blocks[:, 4:8], 32) << 4
    return d * (_nibbles(blocks[:, 8:24]) | high).float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return d * blocks[:, 2:34].contiguous().view(torch.int8).float()


# MXFP4 (gpt-oss's experts): E2M1 codes as their doubled values (ggml's kvalues_mxfp4), and a power-of-two scale.
_E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """32 elements: one E8M0 exponent byte e (scale 2^(e - 127)), then 16 bytes of 4-bit E2M1 codes (element j in
    the low nibble of byte j, element j + 16 in its high one). The doubled code values take half the scale."""
    e = blocks[:, :1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128) as float bits; e < 2 is subnormal there (bit 21 + e of the mantissa).
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    half_scale = bits.view(torch.float32)
    return half_scale * _E2M1_DOUBLED[_nibbles(blocks[:, 1:17]).long()]


def _f16_block(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16_block(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _f32_block(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32).clone()


# name -> (elements per block, bytes per block, dequantizer)
_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (1, 4, _f32_block),
    "F16": (1, 2, _f16_block),
    "BF16": (1, 2, _bf16_block),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    **{kind: (QK_K, TYPE_BYTES[kind], partial(dequantize_kquant, kind)) for kind in KQUANT_KINDS},
    "MXFP4": (32, 17, _mxfp4),
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(_TYPES)


# ggml's type ids (enum ggml_type), including types we cannot decode, so errors can name them.
_TYPE_IDS: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 39: "MXFP4",
}


def ggml_type_name(type_id: int) -> str:
    """GGML type id -> its name ("Q4_1"), also for types we cannot decode (for the error message)."""
    return _TYPE_IDS.get(type_id, f"unknown type {type_id}")


def _layout(type_name: str, shape: tuple[int, ...]) -> tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]:
    if type_name not in _TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor type {type_name} is not supported; supported types: {', '.join(SUPPORTED_TYPES)}"
        )
    block_elems, block_bytes, decode = _TYPES[type_name]
    num_elements = int(np.prod(shape))
    if num_elements % block_elems:
        raise UnsupportedModelError(
            f"tensor of {num_elements} elements is not a whole number of {type_name} blocks ({block_elems})"
        )
    return num_elements // block_elems, block_bytes, decode


def tensor_nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` takes in the file at `type_name`."""
    num_blocks, block_bytes, _ = _layout(type_name, shape)
    return num_blocks * block_bytes


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize the raw bytes of one GGUF tensor to float32 of `shape` (torch order).

    Raises UnsupportedModelError naming the type when kvserve has no decoder for it.
    """
    decode = _layout(type_name, shape)[2]
    return decode(_blocks(raw, type_name, shape)).reshape(shape)


def _blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...], copy: bool = True) -> torch.Tensor:
    """The raw bytes of one tensor as `[num_blocks, block_bytes]` uint8: a copy, as the source is usually a
    read-only memory map; `copy=False`, a view of that map, for a caller that only reads it."""
    num_blocks, block_bytes, _ = _layout(type_name, shape)
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if data.size != num_blocks * block_bytes:
        raise UnsupportedModelError(f"{type_name} tensor has {data.size} bytes, expected {num_blocks * block_bytes}")
    if copy:
        return torch.from_numpy(data.copy()).view(num_blocks, block_bytes)
    with warnings.catch_warnings():  # torch warns of a read-only array; nothing writes to these bytes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data).view(num_blocks, block_bytes)


def _raw_f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte offset `start` of every block, as fp16 [n]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16)[:, 0]


# The 32-element types whose blocks are w = d * code + offset: the offset's multiple of d for those that
# store codes centred on zero (Q4_0's 4-bit codes stand for code - 8), else None: the block stores its min.
_CENTRED = {"Q4_0": -8, "Q4_1": None, "Q5_0": -16, "Q5_1": None, "Q8_0": -128}


def _offsets(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """Each block's offset [n] fp16 for a `_CENTRED` type (overflowing to inf where d is too large for it)."""
    multiple = _CENTRED[type_name]
    return _raw_f16(blocks, 2) if multiple is None else _raw_f16(blocks, 0) * multiple


def _grouped(type_name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """(codes [n, 32] uint8, scale [n] fp16, offset [n] fp16, bits) with w = scale * code + offset, for the
    32-element types whose blocks are exactly that; None for the others."""
    if type_name == "MXFP4":
        return _mxfp4_grouped(blocks)
    if type_name not in _CENTRED:
        return None
    scales, offsets = _raw_f16(blocks, 0), _offsets(type_name, blocks)
    if type_name == "Q4_0":
        return _nibbles(blocks[:, 2:18]), scales, offsets, 4
    if type_name == "Q4_1":
        return _nibbles(blocks[:, 4:20]), scales, offsets, 4
    if type_name == "Q5_0":
        return _nibbles(blocks[:, 6:22]) | (_bits(blocks[:, 2:6], 32) << 4), scales, offsets, 8
    if type_name == "Q5_1":
        return _nibbles(blocks[:, 8:24]) | (_bits(blocks[:, 4:8], 32) << 4), scales, offsets, 8
    codes = (blocks[:, 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # Q8_0
    return codes, scales, offsets, 8


# MXFP4's doubled E2M1 values (_E2M1_DOUBLED) shifted by 12 to be unsigned codes 0..24: w = s * (code - 12).
MXFP4_LEVELS = (_E2M1_DOUBLED + 12).to(torch.uint8)
# Exponents whose half scale 2^(e - 128) and offset -12 * 2^(e - 128) are both exact fp16 values.
_MXFP4_FP16_EXPONENTS = (104, 140)


def _mxfp4_exponents_fit(exponents: torch.Tensor) -> bool:
    """Whether every block's exponent byte gives a scale and offset fp16 holds exactly."""
    low, high = _MXFP4_FP16_EXPONENTS
    return bool(exponents.numel()) and low <= int(exponents.min()) and int(exponents.max()) <= high


def mxfp4_held_exactly(raw: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether every block of an MXFP4 matrix has an exponent `group_codes` holds exactly (its scale bytes only)."""
    return _mxfp4_exponents_fit(_blocks(raw, "MXFP4", shape, copy=False)[:, 0])


def _mxfp4_grouped(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """MXFP4 as group codes: the file's 4-bit codes, whose levels (`MXFP4_LEVELS`: doubled E2M1 value + 12) the
    group's table holds, scale 2^(e - 128), offset -12 scale; every weight exactly the file's. None where an
    exponent lies outside fp16's exact range (the caller then dequantizes, as before)."""
    e = blocks[:, 0].to(torch.int32)
    if not _mxfp4_exponents_fit(e):
        return None
    scales = torch.ldexp(torch.ones(e.shape), (e - 128).float()).half()
    return _nibbles(blocks[:, 1:17]), scales, scales * -12, 4


def group_codes(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> GroupCodes | None:
    """The raw bytes of a 2-D GGUF matrix as group codes (kvserve.kernels.packing), exactly the file's
    values, where its type is a 32-element group of w = d * q + m (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), or of
    w = s * level[q] - 12 s (MXFP4: its codes and their table of levels); None for other types, or where an
    offset (-8d, -16d, -128d, -12s: exact multiples) would overflow fp16."""
    if len(shape) != 2 or type_name not in _TYPES:
        return None
    grouped = _grouped(type_name, _blocks(raw, type_name, shape))
    if grouped is None:
        return None
    codes, scales, offsets, bits = grouped
    if not fits_fp16(offsets.float()):
        return None
    rows, cols = shape
    groups = cols // 32
    return GroupCodes(codes.reshape(rows, cols).contiguous(), scales.reshape(rows, groups).contiguous(),
                      offsets.reshape(rows, groups).contiguous(), bits,
                      MXFP4_LEVELS if type_name == "MXFP4" else None)


def codes_held_exactly(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether `kquant_codes` or `group_codes` gives this 2-D matrix's own codes, every weight exactly the
    file's: so a loader whose layers hold codes never needs its fp32 (GGUFModel.weights). Reads the blocks'
    scales only, not their codes."""
    if len(shape) != 2:
        return False
    if type_name in KQUANT_KINDS:
        return True
    if type_name == "MXFP4":
        return mxfp4_held_exactly(raw, shape)
    return type_name in _CENTRED and fits_fp16(_offsets(type_name, _blocks(raw, type_name, shape, copy=False)).float())


def kquant_codes(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> KQuantCodes | None:
    """The raw bytes of a 2-D GGUF matrix as its K-quant super-blocks (Q4_K, Q5_K, Q6_K), exactly the file's;
    None for other types. The blocks are a view of the file's read-only memory map, not a copy: the layer
    reads them once, repacking them (kvserve.model.kquant_linear), and keeps only what it packed."""
    if len(shape) != 2 or type_name not in KQUANT_KINDS:
        return None
    blocks = _blocks(raw, type_name, shape, copy=False)
    return KQuantCodes(type_name, blocks.view(shape[0], shape[1] // QK_K, TYPE_BYTES[type_name]))
