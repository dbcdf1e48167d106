"""Linear layers whose weights are held below fp32: bf16, int8 per channel, int4 in groups of 32.

Weights stream in as fp32 (every loader stays the same) and each layer is
converted once, after loading (`convert_linear_weights`). Which kernel runs
depends on the step's rows, measured on the CPU (AMD EPYC, Zen 4, AVX512-BF16,
2 threads, torch 2.13; us per call, weights hot):

                          rows:    1      4      8     32
    QKV 576 -> 960      int4      20     52    110    386
                        bf16      55     61     75    156
                        fp32      49    115    191    374
    lm_head 576 -> 49152 int4    793   1441   4522  13872
                        bf16    3330   5474   6887   8873
                        fp32   10213  19401  21005  29994

The packed-weight kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
read a quarter / half of fp32's bytes and win at a few rows (decode at small
batch); past `PACKED_MAX_ROWS` a bf16 GEMM wins (prefill, batched decode), so
the quantized methods also keep the weight dequantized to bf16 for those. Both
kernels need bf16 activations: fed fp32 they ran 10-60x slower, so every path
here casts the input to bf16 and the output back to fp32. On a CPU without
native bf16 (`has_fast_bf16_matmul()` false) these methods are slow, and
`weights_dtype="auto"` keeps fp32 there.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import WEIGHTS_DTYPES, ModelConfig
from kvserve.cpu_features import has_fast_bf16_matmul
from kvserve.errors import ConfigError
from kvserve.model.layers import Linear, UnquantizedLinearMethod

INT4_GROUP_SIZE = 32  # the GGUF Q4_0/Q4_1 block: a Q4_1 file's groups map one to one
PACKED_MAX_ROWS = 4  # rows up to which the packed kernels beat a bf16 GEMM (table above)
_INT4_INNER_K_TILES = 8  # the CPU packing's tile; the kernel takes any value it was packed with


# GGUF types whose weights int4 groups of 32 re-pack exactly (scale d, zero m + 8d).
EXACT_INT4_SOURCES = frozenset({"Q4_0", "Q4_1"})


def resolve_weights_dtype(weights_dtype: str, input_sizes: Iterable[int] = (), exact_int4: bool = True) -> str:
    """"auto" -> int4 where bf16 GEMMs are native (the fastest measured; int8 if a linear layer's input
    size is not a multiple of the int4 group), else float32. `exact_int4=False` (a GGUF file whose linear
    weights are other quantizations, e.g. Q4_K / Q6_K) makes it bfloat16 instead: re-quantizing those to
    int4 compounds two roundings (Gemma 3 270M's Q4_K_M file, bench/weights_accuracy.py: int4 +15.8%
    perplexity, int8 +0.57%, bfloat16 -0.07%)."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ConfigError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {weights_dtype!r}")
    if weights_dtype == "auto":
        if not has_fast_bf16_matmul():
            return "float32"
        if not exact_int4:
            return "bfloat16"
        return "int8" if any(size % INT4_GROUP_SIZE for size in input_sizes) else "int4"
    return weights_dtype


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Bf16LinearMethod(UnquantizedLinearMethod):
    """bf16 weights, bf16 GEMM, fp32 in and out (the residual stream stays fp32)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.weight = _frozen(layer.weight.detach().to(torch.bfloat16))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return _dense_bf16(layer, x)


class _PackedLinearMethod(UnquantizedLinearMethod):
    """Packed low-bit weights for a few rows (decode), the bf16 dequantized copy for more."""

    @abc.abstractmethod
    def packed_matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x `[N <= PACKED_MAX_ROWS, in]` bf16 -> `[N, out]` bf16, from the packed weight (each format's kernel)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > PACKED_MAX_ROWS:
            return _dense_bf16(layer, x)
        y = self.packed_matmul(layer, x.to(torch.bfloat16)).float()
        return y if layer.bias is None else y + layer.bias


class Int8LinearMethod(_PackedLinearMethod):
    """Symmetric int8 per output channel (scale = max|w| / 127), plus the bf16 dequantized weight."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        layer.qweight = _frozen(codes)
        layer.scales = _frozen(scales.to(torch.bfloat16))
        layer.weight = _frozen((codes.float() * layer.scales.float()[:, None]).to(torch.bfloat16))

    def packed_matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales)


class Int4LinearMethod(_PackedLinearMethod):
    """Asymmetric 4-bit codes in groups of 32 along the input (Q4_1's layout), plus the bf16 dequantized weight.

    w = scale * (q - 8) + zero with q in 0..15, scale = (max - min) / 15 and
    zero = min + 8 * scale per group: a Q4_1 block (d, m) is scale = d,
    zero = m + 8d, so a group's min and max fall on codes 0 and 15 exactly as
    llama.cpp put them. The kernel holds scale and zero in bf16.
    """

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        rows, cols = weight.shape
        if cols % INT4_GROUP_SIZE:
            raise ConfigError(f"int4 weights need input sizes divisible by {INT4_GROUP_SIZE}; this layer has {cols}")
        codes, scales, zeros = quantize_int4_groups(weight)
        layer.qweight = _frozen(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INT4_INNER_K_TILES))
        # [groups, rows, 2] as the kernel takes them.
        layer.scales_and_zeros = _frozen(torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous())
        layer.weight = _frozen(dequantize_int4_groups(codes, layer.scales_and_zeros).to(torch.bfloat16))

    def packed_matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP_SIZE, layer.scales_and_zeros)


def quantize_int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight `[rows, cols]` fp32 -> codes `[rows, cols]` int32 in 0..15, scales and zeros `[rows, groups]`."""
    rows, cols = weight.shape
    groups = weight.view(rows, cols // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return codes.view(rows, cols), scales, low + 8 * scales


def dequantize_int4_groups(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: codes `[rows, cols]`, scales_and_zeros `[groups, rows, 2]` -> fp32 weight."""
    rows, cols = codes.shape
    scale = scales_and_zeros[..., 0].float().T[..., None]  # [rows, groups, 1]
    zero = scales_and_zeros[..., 1].float().T[..., None]
    grouped = codes.view(rows, cols // INT4_GROUP_SIZE, INT4_GROUP_SIZE).float()
    return ((grouped - 8) * scale + zero).view(rows, cols)


def _dense_bf16(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    y = F.linear(x.to(torch.bfloat16), layer.weight).float()
    return y if layer.bias is None else y + layer.bias


_METHODS: dict[str, type[UnquantizedLinearMethod]] = {
    "float32": UnquantizedLinearMethod, "bfloat16": Bf16LinearMethod, "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
}


# The output projection keeps 8 bits under int4, as llama.cpp's 4-bit mixes keep it at Q6_K/Q8_0: the
# embedded model's head is Q8_0 in the file; quantized to int4 groups its weights move 9% (relative
# norm) against 1.2% for int8 per channel, and the logits of a 12-token prompt 1.2% (int8 head) vs
# 0.9% (bf16 head) from fp32, while int8's kernel is 2x bf16's at batch 1.
_HEAD_DTYPE = {"int4": "int8"}
HEAD_NAME = "lm_head"


def linear_held_bytes(rows: int, cols: int, bias: bool, dtype: str) -> int:
    """Bytes a `Linear` of `rows` x `cols` holds once converted to `dtype` (what the methods above create)."""
    bias_bytes = 4 * rows if bias else 0
    dense_bf16 = 2 * rows * cols  # the copy the quantized methods keep for many-row GEMMs
    held = {
        "float32": 4 * rows * cols,
        "bfloat16": dense_bf16,
        "int8": rows * cols + 2 * rows + dense_bf16,  # codes, bf16 scales
        "int4": rows * cols // 2 + (cols // INT4_GROUP_SIZE) * rows * 2 * 2 + dense_bf16,  # packed, bf16 scale+zero
    }[dtype]
    return held + bias_bytes


def held_weight_bytes(config: ModelConfig, weights_dtype: str) -> int:
    """Bytes a Llama-family model of `config` holds with `weights_dtype` ("auto" resolved on this CPU):
    fp32 embedding and norms, each linear in its converted format. `kvserve memory` plans with it."""
    dtype = resolve_weights_dtype(weights_dtype, (config.hidden_size, config.num_heads * config.head_dim,
                                                  config.intermediate_size))
    hidden, q_size, kv_size = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (linear_held_bytes(q_size + 2 * kv_size, hidden, config.attention_bias, dtype)
                 + linear_held_bytes(hidden, q_size, False, dtype)
                 + linear_held_bytes(2 * config.intermediate_size, hidden, False, dtype)
                 + linear_held_bytes(hidden, config.intermediate_size, False, dtype)
                 + 2 * 4 * hidden)  # two RMSNorm weights
    embedding = 4 * config.vocab_size * hidden
    head_dtype = _HEAD_DTYPE.get(dtype, dtype)
    shares_embedding = config.tie_word_embeddings and dtype == "float32"
    head = 0 if shares_embedding else linear_held_bytes(config.vocab_size, hidden, False, head_dtype)
    return config.num_layers * per_layer + embedding + head + 4 * hidden  # final norm


def convert_linear_weights(model: nn.Module, weights_dtype: str, exact_int4: bool = True) -> str:
    """Convert every loaded `Linear` of `model` to `weights_dtype` ("auto" resolved here, see
    `resolve_weights_dtype`); returns the dtype used."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    resolved = resolve_weights_dtype(weights_dtype, (m.input_size for _, m in linears), exact_int4)
    if resolved == "float32":
        return resolved
    for name, module in linears:
        dtype = _HEAD_DTYPE.get(resolved, resolved) if name == HEAD_NAME else resolved
        module.method = _METHODS[dtype]()
        module.method.process_weights_after_loading(module)
    return resolved
