"""Writing one tensor of a test's GGUF twin: as F32, or quantized by the gguf package, and what the file then
holds (the GGUF writers of tests/gemma4_variants.py and tests/qwen35_variants.py)."""

from __future__ import annotations

import numpy as np
import torch


def quant_type(hf_name: str, data: np.ndarray, quant_types: dict[str, str] | None) -> str:
    """The GGML type for `hf_name`: the first of `quant_types` whose key it contains, for a matrix; else F32."""
    if data.ndim != 2:
        return "F32"
    return next((qtype for key, qtype in (quant_types or {}).items() if key in hf_name), "F32")


def add_tensor(writer, gguf_name: str, data: np.ndarray, qtype: str) -> torch.Tensor:
    """Add `data` to `writer` as `qtype`; returns what the file holds, dequantized, as float32 of data's shape."""
    import gguf
    from gguf.quants import dequantize, quantize

    if qtype == "F32":
        writer.add_tensor(gguf_name, np.ascontiguousarray(data))
        return torch.from_numpy(np.array(data, dtype=np.float32))
    ggml_type = gguf.GGMLQuantizationType[qtype]
    packed = quantize(data, ggml_type)
    writer.add_tensor(gguf_name, packed, raw_dtype=ggml_type)
    return torch.from_numpy(dequantize(packed, ggml_type).copy()).view(data.shape)
