"""KV-cache element codecs: how one (token, KV head) row of `head_dim` values is stored.

Every codec stores `data` (the elements, possibly packed) and `params` (float16
per-row quantization parameters, possibly none), both laid out per block like
the cache itself, so a block's parameters move, are shared and are freed with
it. Float codecs just convert.

- int8: symmetric, one scale per (token, KV head): x ~ q * scale, q in [-127, 127].
- int4: asymmetric per group of `INT4_GROUP` channels: x ~ q * scale + min,
  q in [0, 15], two values per byte (even channel in the low nibble).
- fp8 (e4m3 / e5m2): one scale per (token, KV head) mapping the row's absmax
  to the format's largest finite value; values are clamped before the cast,
  because an out-of-range cast to e4m3fn yields NaN rather than saturating.
- int4 keys (`key_codec`): per channel over a whole block (KIVI, ICML 2024): a
  few key channels carry outliers across every token, and a per-token group's
  scale is set by them, crushing the rest. Each (block, KV head) gets a float16
  scale and minimum per channel, computed over the block's `block_size` rows,
  so a block is encoded only once it is full (storage keeps the block being
  filled in float16 until then: kv/cache/open_blocks.py). Its parameters (2 x
  head_dim per block and head) are spread over the block's rows, `param_width`
  per row, so they share the cache's layout. Values stay per token.

Scale codecs (int8, fp8) let attention fold the scale into the scores (K) and
the probabilities (V) instead of rescaling every element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PARAM_DTYPE = torch.float16  # per-row scales / minimums
# The block size whose bytes per token `bytes_per_token` reports (the engine's default): a blockwise codec's
# parameters per token depend on the block size (KVSpec.page_bytes takes the real one).
REFERENCE_BLOCK = 16
OPEN_BLOCK_DTYPE = torch.float16  # a block still being filled, before a blockwise codec can encode it
# Channels per int4 group. Measured on 2,048 tokens of English (bench/kv_quant_accuracy.py,
# SmolLM2): groups of 32 cost +4.8% perplexity, groups of 16 +2.4% for 20% more bytes.
INT4_GROUP = 16
_TINY = 1e-6  # smallest scale: an all-zero row must not divide by zero
_PARAM_MAX = torch.finfo(PARAM_DTYPE).max  # larger parameters saturate instead of becoming inf


def _to_params(x: torch.Tensor, low: float) -> torch.Tensor:
    return x.clamp(low, _PARAM_MAX).to(PARAM_DTYPE)


@dataclass(frozen=True)
class KVCodec:
    name: str
    storage_dtype: torch.dtype
    bits: int  # per element
    kind: str  # "float", "scale" (x = q * s), "affine4" (int4 groups per token) or "channel" (per block)
    qmax: float = 0.0  # largest representable magnitude (scale codecs)

    def data_width(self, head_dim: int) -> int:
        """Stored elements per row (int4 packs two values per byte)."""
        return head_dim // 2 if self.bits == 4 else head_dim

    @property
    def blockwise(self) -> bool:
        """Parameters per (block, KV head), over the block's rows: a block is encoded once, when full."""
        return self.kind == "channel"

    def num_params(self, head_dim: int, block_size: int = REFERENCE_BLOCK) -> int:
        """float16 parameters per row (a blockwise codec's 2 x head_dim per block, spread over its rows)."""
        if self.kind == "scale":
            return 1
        if self.kind == "affine4":
            return 2 * (head_dim // int4_group(head_dim))
        if self.kind == "channel":
            return -(-2 * head_dim // block_size)
        return 0

    def bytes_per_row(self, head_dim: int, block_size: int = REFERENCE_BLOCK) -> int:
        """Bytes one (token, KV head) row takes, parameters included (a blockwise codec's share of its
        block's parameters: they depend on the block size)."""
        return head_dim * self.bits // 8 + self.num_params(head_dim, block_size) * PARAM_DTYPE.itemsize

    @property
    def is_fp8(self) -> bool:
        """fp8 elements: no fast CPU arithmetic, and no index_copy_/index_select on CPU."""
        return self.storage_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def folds_scale(self) -> bool:
        return self.kind == "scale"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x `[..., head_dim]` float -> (data `[..., data_width]`, params `[..., num_params]` or None)."""
        if self.kind == "float":
            return x.to(self.storage_dtype), None
        if self.kind == "scale":
            scale = _to_params(x.abs().amax(dim=-1, keepdim=True) / self.qmax, _TINY)
            scaled = x / scale.float()
            if self.storage_dtype == torch.int8:
                data = scaled.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
            else:
                data = scaled.clamp_(-self.qmax, self.qmax).to(self.storage_dtype)
            return data, scale
        return _encode_int4(x)

    def elements(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored elements as `dtype`, before any scale."""
        if self.storage_dtype == torch.float8_e4m3fn:
            # torch's own e4m3 -> float32 cast runs ~5x slower on this CPU than a 256-entry table.
            table = _E4M3_TABLE.to(data.device, dtype)
            return table.index_select(0, data.view(torch.uint8).reshape(-1).int()).view(data.shape)
        return data.to(dtype)

    def decode(self, data: torch.Tensor, params: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of `encode`, in `dtype`: `[..., data_width]` -> `[..., head_dim]`."""
        if self.kind == "float":
            return data.to(dtype)
        if self.kind == "scale":
            return self.elements(data, dtype) * params.to(dtype)
        if self.kind == "channel":
            raise ValueError("a blockwise codec decodes whole blocks (decode_blocks) or rows with their block's "
                             "parameters (decode_rows)")
        return _decode_int4(data, params, dtype)

    def encode_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole blocks `[..., block_size, head_dim]` -> (data `[..., block_size, data_width]`, params
        `[..., block_size, num_params]` or None); per-row codecs encode each row."""
        if self.kind != "channel":
            return self.encode(x)
        block_size, head_dim = x.shape[-2:]
        x = x.float()
        low = _to_params(x.amin(dim=-2, keepdim=True), -_PARAM_MAX)  # [..., 1, D]: per channel, over the rows
        scale = _to_params((x.amax(dim=-2, keepdim=True) - low.float()) / self.levels, _TINY)
        q = _levels((x - low.float()) / scale.float(), self.levels)
        data = q[..., 0::2] | (q[..., 1::2] << 4) if self.bits == 4 else q
        width = self.num_params(head_dim, block_size)
        params = torch.zeros(*x.shape[:-2], block_size * width, dtype=PARAM_DTYPE, device=x.device)
        params[..., :head_dim] = scale[..., 0, :]
        params[..., head_dim : 2 * head_dim] = low[..., 0, :]
        return data, params.view(*x.shape[:-2], block_size, width)

    def decode_blocks(self, data: torch.Tensor, params: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of `encode_blocks`: `[..., block_size, data_width]` -> `[..., block_size, head_dim]`."""
        if self.kind != "channel":
            return self.decode(data, params, dtype)
        head_dim = self.head_dim_of(data)
        flat = params.flatten(-2)
        scale, low = flat[..., None, :head_dim].to(dtype), flat[..., None, head_dim : 2 * head_dim].to(dtype)
        return torch.addcmul(low, self._levels_of(data, dtype), scale)

    def decode_rows(self, data: torch.Tensor, block_params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `[n, data_width]` of a blockwise codec, each with its (block, head)'s parameters `[n, >= 2 x
        head_dim]` -> `[n, head_dim]`."""
        head_dim = self.head_dim_of(data)
        scale, low = block_params[:, :head_dim].to(dtype), block_params[:, head_dim : 2 * head_dim].to(dtype)
        return torch.addcmul(low, self._levels_of(data, dtype), scale)

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def head_dim_of(self, data: torch.Tensor) -> int:
        return data.shape[-1] * (2 if self.bits == 4 else 1)

    def _levels_of(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored unsigned levels as `dtype`, unpacked: `[..., data_width]` -> `[..., head_dim]`."""
        if self.bits != 4:
            return data.to(dtype)
        table = _NIBBLE_TABLE.to(data.device, dtype)
        return table.index_select(0, data.reshape(-1).int()).view(*data.shape[:-1], 2 * data.shape[-1])


def int4_group(head_dim: int) -> int:
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def _levels(x: torch.Tensor, top: int) -> torch.Tensor:
    """Non-negative x rounded to the nearest level in [0, top], as uint8. x + 0.5 truncated by the cast, not
    round_(): on this CPU torch's round_ took ~15 ms for a block's 3,072 values under load, the cast 8 us."""
    return x.add_(0.5).clamp_(0, top + 0.5).to(torch.uint8)


def _encode_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = x.shape[-1]
    group = int4_group(head_dim)
    grouped = x.float().reshape(*x.shape[:-1], head_dim // group, group)
    low = _to_params(grouped.amin(dim=-1, keepdim=True), -_PARAM_MAX)
    scale = _to_params((grouped.amax(dim=-1, keepdim=True) - low.float()) / 15, _TINY)
    q = _levels((grouped - low.float()) / scale.float(), 15)
    q = q.reshape(*x.shape[:-1], head_dim)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    params = torch.cat([scale, low], dim=-1).reshape(*x.shape[:-1], -1)  # [scale_g, min_g] per group
    return packed, params


def _decode_int4(data: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    head_dim = data.shape[-1] * 2
    group = int4_group(head_dim)
    # One table lookup per byte gives both nibbles (~25% faster than masking, shifting and stacking).
    q = _NIBBLE_TABLE.to(data.device, dtype).index_select(0, data.reshape(-1).int())
    q = q.view(*data.shape[:-1], head_dim // group, group)
    scale_low = params.to(dtype).view(*data.shape[:-1], head_dim // group, 2)
    return torch.addcmul(scale_low[..., 1:], q, scale_low[..., :1]).view(*data.shape[:-1], head_dim)


# Lookup tables, built once on the CPU; `elements` and `_decode_int4` take them to the data's device.
_NIBBLE_TABLE = torch.stack([torch.arange(256, device="cpu") & 0x0F, torch.arange(256, device="cpu") >> 4], dim=-1).float()  # byte -> (lo, hi)
_E4M3_TABLE = torch.arange(256, dtype=torch.uint8, device="cpu").view(torch.float8_e4m3fn).float()  # every byte's value


def _float(name: str, dtype: torch.dtype) -> KVCodec:
    return KVCodec(name, dtype, torch.finfo(dtype).bits, "float")


def key_codec(name: str) -> KVCodec:
    """The codec keys are stored with: int4 keys per channel over each block (see the module's doc); any
    other dtype as values. Measured (bench/kv_quant_accuracy.py, float32 weights, 2,048-token windows):
    int4 +2.70% -> +0.26% perplexity on SmolLM2, +3.33% -> +0.29% on Gemma 3 270M; int8 keys per token cost
    +0.17% / +0.36%, within +0.5%, so they keep one scale per row and need no float16 block."""
    return KEY_CODECS.get(name) or CODECS[name]


CODECS: dict[str, KVCodec] = {
    "float32": _float("float32", torch.float32),
    "float16": _float("float16", torch.float16),
    "bfloat16": _float("bfloat16", torch.bfloat16),
    "int8": KVCodec("int8", torch.int8, 8, "scale", qmax=127.0),
    "int4": KVCodec("int4", torch.uint8, 4, "affine4"),
    "fp8_e4m3": KVCodec("fp8_e4m3", torch.float8_e4m3fn, 8, "scale", qmax=torch.finfo(torch.float8_e4m3fn).max),
    "fp8_e5m2": KVCodec("fp8_e5m2", torch.float8_e5m2, 8, "scale", qmax=torch.finfo(torch.float8_e5m2).max),
}

KEY_CODECS: dict[str, KVCodec] = {"int4": KVCodec("int4", torch.uint8, 4, "channel")}
