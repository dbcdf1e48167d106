"""fp32 matrices -> GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K) in ggml's byte layout, for writing test and
benchmark files (the `gguf` package quantizes Q4_0 / Q8_0 but not K-quants).

Plain min/max scales, rounded to nearest: a valid file of the right size and layout, not llama.cpp's
quality (its quantizer searches each sub-block's scale and min to cut the error further). The layouts
are those kquant_packing.kquant_fields reads.
"""

from __future__ import annotations

import torch

from kvserve.kernels.kquant_packing import SUPER_BLOCK, TYPE_BYTES


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.half().contiguous().view(torch.uint8).view(-1, 2)


def _pack_scales_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and 8 six-bit mins per block (uint8 [n, 8] each) -> ggml's 12-byte field."""
    low = (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6)
    middle = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    high = (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return torch.cat([low, middle, high], dim=1)


def _ratio_codes(values: torch.Tensor, unit: torch.Tensor, top: int) -> torch.Tensor:
    """round(values / unit) clamped to 0..top, 0 where the unit is 0."""
    safe = torch.where(unit > 0, unit, torch.ones_like(unit))
    return torch.where(unit > 0, torch.round(values / safe), torch.zeros_like(values)).clamp(0, top)


def _q45_k(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    n = blocks.shape[0]
    sub = blocks.view(n, 8, 32)
    low = sub.amin(dim=-1).clamp(max=0)  # w = d * sc * q - dmin * mn, mn >= 0
    span_scale = (sub.amax(dim=-1) - low) / (2**bits - 1)
    d = (span_scale.amax(dim=-1) / 63).half().float()
    dmin = (-low).amax(dim=-1).div(63).half().float()
    sc = _ratio_codes(span_scale, d[:, None], 63)
    mn = _ratio_codes(-low, dmin[:, None], 63)
    unit = d[:, None, None] * sc[..., None]
    codes = _ratio_codes(sub + (dmin[:, None] * mn)[..., None], unit, 2**bits - 1).to(torch.uint8)
    nibbles = (codes & 15).view(n, 4, 2, 32)  # chunk i: sub-blocks 2i (low nibble) and 2i + 1 (high)
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(n, 128)
    head = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc.to(torch.uint8), mn.to(torch.uint8))]
    if bits == 4:
        return torch.cat([*head, qs], dim=1)
    fifth = (codes >> 4) & 1  # [n, 8 sub-blocks, 32]: bit i of qh[l] is sub-block i's element l
    qh = (fifth << torch.arange(8, dtype=torch.uint8).view(1, 8, 1)).sum(dim=1, dtype=torch.uint8)
    return torch.cat([*head, qh, qs], dim=1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sub = blocks.view(n, 16, 16)
    scale = sub.abs().amax(dim=-1) / 31  # q - 32 in -32..31: the largest magnitude at 31
    d = (scale.amax(dim=-1) / 127).half().float()
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    sc = torch.where(d[:, None] > 0, torch.round(scale / safe_d[:, None]), torch.zeros_like(scale)).clamp(-128, 127)
    unit = d[:, None, None] * sc[..., None]
    safe = torch.where(unit != 0, unit, torch.ones_like(unit))
    signed = torch.where(unit != 0, torch.round(sub / safe), torch.zeros_like(sub)).clamp(-32, 31)
    codes = (signed + 32).to(torch.uint8).view(n, 2, 4, 32)  # [half, group k, l]
    ql = (codes[:, :, 0:2] & 15) | ((codes[:, :, 2:4] & 15) << 4)  # [n, half, ql[l] / ql[l + 32], l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((codes >> 4) << shifts).sum(dim=2, dtype=torch.uint8)  # [n, half, l]
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(d)], dim=1)


def quantize_kquant(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 `[rows, cols]` (cols a multiple of 256) -> uint8 `[rows, cols // 256 * type bytes]`, the tensor
    data of a GGUF matrix of `kind` ("Q4_K", "Q5_K", "Q6_K")."""
    rows, cols = weight.shape
    if cols % SUPER_BLOCK or kind not in TYPE_BYTES:
        raise ValueError(f"{kind} needs a K-quant type and inputs in multiples of {SUPER_BLOCK}; got {cols}")
    blocks = weight.float().reshape(-1, SUPER_BLOCK)
    data = _q6_k(blocks) if kind == "Q6_K" else _q45_k(blocks, 4 if kind == "Q4_K" else 5)
    if data.shape[1] != TYPE_BYTES[kind]:  # a layout bug, never bad input
        raise RuntimeError(f"{kind} quantized to {data.shape[1]} bytes a super-block, not {TYPE_BYTES[kind]}")
    return data.reshape(rows, -1)
