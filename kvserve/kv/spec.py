"""How many bytes one token of KV cache takes: the ONE formula (DESIGN §3).

The loader's summary, the cache allocator and (later) the memory planner all
call `kv_bytes_per_token`; nothing else in kvserve may recompute it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.errors import InvalidRequestError

# Element sizes of the cache dtypes kvserve can store.
_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
}

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_cache_dtype(name: str) -> str:
    """Map a user-facing cache dtype name (`auto` included) to a canonical one."""
    canonical = {"auto": "float32", "fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    resolved = canonical.get(name, name)
    if resolved not in _DTYPE_BYTES:
        raise InvalidRequestError(f"unsupported KV cache dtype {name!r}; choose one of: auto, {', '.join(_DTYPE_BYTES)}")
    return resolved


def torch_cache_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[resolve_cache_dtype(name)]


@dataclass(frozen=True, slots=True)
class KVSpec:
    """KV-cache geometry of one model at one cache dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_element(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        # 2 = one K row and one V row per KV head.
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer


def kv_spec(config: ModelConfig, dtype: str = "auto") -> KVSpec:
    return KVSpec(config.num_layers, config.num_kv_heads, config.head_dim, resolve_cache_dtype(dtype))


def kv_bytes_per_token(config: ModelConfig, dtype: str = "auto") -> int:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element."""
    return kv_spec(config, dtype).bytes_per_token
