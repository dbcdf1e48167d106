"""Linear layers whose weights are held below fp32: bf16, or 8-/4-bit codes in groups of 32.

Weights stream in as fp32 (every loader stays the same) and each layer is
converted once, after loading (`convert_linear_weights`). The int8 and int4
layers hold only packed codes (kvserve/kernels/packing.py) and multiply them
with kvserve's C++ kernel (kernels/csrc/quant_matmul.cpp): activations
quantized to int8 per group of 32, integer dot products (AVX512-VNNI, or
AVX2), one fp16 scale and offset per (row, group). Where the checkpoint is a
GGUF file whose matrices are such groups (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), the
file's own codes, scales and offsets are packed: the weights are exactly the
file's. Measured on an AMD EPYC (Zen 4, AVX512-VNNI, 2 threads, torch 2.13;
us per call, weights cold as across 30 layers; the aten packed-int4 kernel,
which needs bf16 activations, is what this replaced):

                          rows:      1      4      8     32    2048
    QKV 576 -> 960      int4       16     19     23     80    7,080
                        int8       23     24     27    104    6,013
                        aten int4  35     39     64    229        -
                        bf16      192    116    126    186    6,744
                        fp32      253    256    230    358   14,701
    lm_head 576 -> 49152 int4     258    588    871  3,528
                        int8      752  1,004  1,156  3,954
                        bf16    3,453  5,210  4,462  7,986
                        fp32   10,400 17,562 17,213 27,193

So one kernel serves decode, batched decode and prefill (no bf16 copy of the
weights is kept), and a row's result does not depend on the batch it is in.
Without the C++ kernels the int8/int4 formats are refused and "auto" picks
bf16 or fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import WEIGHTS_DTYPES, ModelConfig
from kvserve.cpu_features import has_fast_bf16_matmul
from kvserve.errors import ConfigError
from kvserve.kernels import ops
from kvserve.kernels.kquant_packing import KQUANT_KINDS, KQuantCodes
from kvserve.kernels.packing import GROUP_SIZE, GroupCodes, pack, packed_bytes, quantize_groups, zero_point
from kvserve.model.float_gemm import row_invariant_linear
from kvserve.model.kquant_linear import KQuantLinearMethod
from kvserve.model.layers import Linear, UnquantizedLinearMethod
from kvserve.model.weights import hf_name

# GGUF types whose weights "int4" holds exactly: Q4_0 / Q4_1 as 4-bit groups (the file's codes, scale and
# offset), MXFP4 as 4-bit codes through its table of levels, K-quants as their own super-blocks
# (kvserve.model.kquant_linear); K-quants and MXFP4 so under int4 and int8 alike.
EXACT_INT4_SOURCES = frozenset({"Q4_0", "Q4_1", "MXFP4", *KQUANT_KINDS})
GROUP_BITS = {"int8": 8, "int4": 4}

# The source of a checkpoint's own group codes: HF name of a weight -> its codes, or None.
CodeSource = Callable[[str], "GroupCodes | KQuantCodes | None"]


def packed_kernel_isa() -> str | None:
    """The instruction set the quantized matmul runs on here ("avx512_vnni", "avx2", "portable"), or None
    where the C++ kernels are not built."""
    return ops.quant_matmul_isa()


def resolve_weights_dtype(weights_dtype: str, input_sizes: Iterable[int] = (), exact_int4: bool = True) -> str:
    """"auto" -> the fastest measured option that keeps accuracy on this CPU: int4 where the quantized
    matmul has a SIMD path (AVX512-VNNI or AVX2) and every input size is a multiple of the group; but
    `exact_int4=False` (a GGUF file whose linear weights include types 4-bit groups do not hold exactly,
    e.g. Q5_0 / Q8_0) makes it int8: re-quantizing those to 4 bits compounds two roundings (Gemma 3 270M's
    file, bench/weights_accuracy.py, before its K-quant layers were held as such: int4 +21.6% perplexity,
    int8 +0.39%, bfloat16 -0.21%; int8 decodes 3x faster than bfloat16 there). K-quant matrices are held
    as their own super-blocks under either. Without the SIMD kernel: bfloat16 where bf16 GEMMs are native, else
    float32. int8 / int4 asked for explicitly need the C++ kernels."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ConfigError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {weights_dtype!r}")
    isa = packed_kernel_isa()
    if weights_dtype in GROUP_BITS and isa is None:
        raise ConfigError(f"--weights-dtype {weights_dtype} needs kvserve's C++ kernels, which are not available "
                          "here (see the log: no compiler, or KVSERVE_NO_CPP_KERNELS); use bfloat16 or float32")
    if weights_dtype != "auto":
        return weights_dtype
    if isa not in (None, "portable") and all(size % GROUP_SIZE == 0 for size in input_sizes):
        return "int4" if exact_int4 else "int8"
    return "bfloat16" if has_fast_bf16_matmul() else "float32"


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Bf16LinearMethod(UnquantizedLinearMethod):
    """bf16 weights, bf16 GEMM, fp32 in and out (the residual stream stays fp32)."""

    def process_weights_after_loading(self, layer: Linear, source: GroupCodes | None = None) -> None:
        layer.weight = _frozen(layer.weight.detach().to(torch.bfloat16))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = row_invariant_linear(x.to(torch.bfloat16), layer.weight, None).float()
        return y if layer.bias is None else y + layer.bias


class GroupQuantizedLinearMethod(UnquantizedLinearMethod):
    """`bits`-bit codes in groups of 32 inputs, packed for the C++ quantized matmul; nothing else is kept."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.table: torch.Tensor | None = None  # what each 4-bit code stands for (GroupCodes.table), if not itself
        self.zero: int | None = None  # the codes' zero point where every offset is -zero * scale (packing.zero_point)

    def process_weights_after_loading(self, layer: Linear, source: GroupCodes | None = None) -> None:
        if source is not None and source.table is not None:
            # 4-bit codes of uneven levels (MXFP4): held as they are, exactly, whether the layers hold 4 or 8
            # bits (the table's levels as 8-bit codes would be the same weights in twice the bytes).
            self.bits, codes = 4, source
            layer.register_buffer("code_table", source.table.contiguous(), persistent=False)
            self.table = layer.code_table  # read per call from here, not through the module's __getattr__
        elif source is not None and source.bits <= self.bits:  # the checkpoint's own codes: held exactly
            codes = GroupCodes(source.codes, source.scales, source.offsets, self.bits)
        else:  # from the codes' values where there are codes: a file's matrix held as codes is never loaded
            codes = quantize_groups(layer.weight.detach() if source is None else source.dequantize(), self.bits)
        self.zero = zero_point(codes)
        layer.packed = _frozen(pack(codes, offsets=self.zero is None))
        layer.weight = None  # a tied head only lets go of the embedding's tensor

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = ops.quant_matmul(rows, layer.packed, self.bits, layer.output_size, table=self.table, zero=self.zero)
        if layer.bias is not None:
            y += layer.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], layer.output_size)


def _method(dtype: str) -> UnquantizedLinearMethod:
    if dtype in GROUP_BITS:
        return GroupQuantizedLinearMethod(GROUP_BITS[dtype])
    return {"float32": UnquantizedLinearMethod, "bfloat16": Bf16LinearMethod}[dtype]()


# The output projection keeps 8 bits under int4, as llama.cpp's 4-bit mixes keep it at Q6_K/Q8_0: the
# embedded model's head is Q8_0 in the file (held exactly as int8 groups); quantized to 4-bit groups its
# weights would move 9% (relative norm).
_HEAD_DTYPE = {"int4": "int8"}
HEAD_NAME = "lm_head"


def linear_held_bytes(rows: int, cols: int, bias: bool, dtype: str) -> int:
    """Bytes a `Linear` of `rows` x `cols` holds once converted to `dtype` (what the methods above create; group
    codes with a zero point, a GGUF Q4_0 / Q8_0 file's, leave out their offsets: 10% / 6% fewer bytes than this)."""
    bias_bytes = 4 * rows if bias else 0
    if dtype in GROUP_BITS:
        return packed_bytes(rows, cols, GROUP_BITS[dtype]) + bias_bytes
    return {"float32": 4, "bfloat16": 2}[dtype] * rows * cols + bias_bytes


def resolve_for_config(config: ModelConfig, weights_dtype: str) -> str:
    """`resolve_weights_dtype` for a model of `config`'s shape (its linear layers' input sizes)."""
    mlp_size = config.moe_intermediate_size if config.num_experts else config.intermediate_size
    return resolve_weights_dtype(weights_dtype, (config.hidden_size, config.num_heads * config.head_dim, mlp_size))


def held_weight_bytes(config: ModelConfig, weights_dtype: str) -> int:
    """Bytes a Llama-family model of `config` holds with `weights_dtype` ("auto" resolved on this CPU):
    fp32 embedding and norms, each linear in its converted format. `kvserve memory` plans with it."""
    dtype = resolve_for_config(config, weights_dtype)
    head_dtype = _HEAD_DTYPE.get(dtype, dtype)
    hidden, q_size, kv_size = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (linear_held_bytes(q_size + 2 * kv_size, hidden, config.attention_bias, dtype)
                 + linear_held_bytes(hidden, q_size, False, dtype)
                 + _mlp_held_bytes(config, dtype, head_dtype)
                 + 2 * 4 * hidden)  # two RMSNorm weights
    embedding = 4 * config.vocab_size * hidden
    shares_embedding = config.tie_word_embeddings and dtype == "float32"
    head = 0 if shares_embedding else linear_held_bytes(config.vocab_size, hidden, False, head_dtype)
    return config.num_layers * per_layer + embedding + head + 4 * hidden  # final norm


def _mlp_held_bytes(config: ModelConfig, dtype: str, router_dtype: str) -> int:
    """One layer's gated MLP, or its experts and their router (held like the head: kvserve.model.moe)."""
    hidden = config.hidden_size
    if not config.num_experts:
        size = config.intermediate_size
        return linear_held_bytes(2 * size, hidden, False, dtype) + linear_held_bytes(hidden, size, False, dtype)
    size = config.moe_intermediate_size
    expert = linear_held_bytes(2 * size, hidden, False, dtype) + linear_held_bytes(hidden, size, False, dtype)
    return config.num_experts * expert + linear_held_bytes(config.num_experts, hidden, False, router_dtype)


def _checkpoint_codes(model: nn.Module, name: str, layer: Linear, source: CodeSource,
                      bits: int) -> GroupCodes | list[KQuantCodes] | None:
    """The checkpoint's own codes for `layer` (module `name`), a fused projection's shards in row order, a
    tied head's from the embedding: the K-quant matrices where every part is one; else group codes stacked,
    where a part has them; None where none has (the layer quantizes its fp32 weight)."""
    embedding = getattr(getattr(model, "embed_tokens", None), "weight", None)
    if name == HEAD_NAME and embedding is not None and layer.weight is embedding:
        names = [("model.embed_tokens.weight", slice(0, layer.output_size))]
    else:
        prefix, _, fused = name.rpartition(".")
        shards = [(part, layer.shard_rows(shard)) for fused_name, part, shard in getattr(model, "stacked_params", ())
                  if fused_name == fused]
        shards.sort(key=lambda item: item[1].start)
        names = ([(hf_name(f"{prefix}.{part}.weight"), rows) for part, rows in shards]
                 or [(hf_name(f"{name}.weight"), slice(0, layer.output_size))])
    parts = [source(n) for n, _ in names]
    if all(isinstance(p, KQuantCodes) for p in parts):
        return parts
    if all(p is None for p in parts):
        return None
    return GroupCodes.cat([_as_groups(p, layer.weight, rows, bits) for p, (_, rows) in zip(parts, names)])


def _as_groups(part: GroupCodes | KQuantCodes | None, weight: torch.Tensor, rows: slice, bits: int) -> GroupCodes:
    """One shard of a projection of mixed types as groups of at most `bits`: the file's own where they fit;
    a K-quant shard (never loaded as fp32: GGUFModel.weights) or wider codes re-quantized from their
    values; a shard without codes from its fp32 rows."""
    if part is None:
        return quantize_groups(weight.detach()[rows], bits)
    if isinstance(part, KQuantCodes) or part.bits > bits:
        return quantize_groups(part.dequantize(), bits)
    return part


def convert_linear_weights(model: nn.Module, weights_dtype: str, exact_int4: bool = True,
                           source: CodeSource | None = None) -> str:
    """Convert every loaded `Linear` of `model` to `weights_dtype` ("auto" resolved here, see
    `resolve_weights_dtype`); `source` gives a GGUF file's own group codes, held as they are where the
    format has room for them. Returns the dtype used."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    resolved = resolve_weights_dtype(weights_dtype, (m.input_size for _, m in linears), exact_int4)
    if resolved == "float32":
        return resolved
    uneven = next(((name, m.input_size) for name, m in linears if m.input_size % GROUP_SIZE), None)
    if resolved in GROUP_BITS and uneven is not None:
        raise ConfigError(f"--weights-dtype {resolved} holds weights in groups of {GROUP_SIZE} inputs, and "
                          f"{uneven[0]} has {uneven[1]}; use bfloat16 or float32 for this model")
    for name, module in linears:
        dtype = _HEAD_DTYPE.get(resolved, resolved) if name == HEAD_NAME or module.keeps_8_bits else resolved
        codes = (_checkpoint_codes(model, name, module, source, GROUP_BITS[dtype])
                 if source and dtype in GROUP_BITS else None)
        module.method = KQuantLinearMethod() if isinstance(codes, list) else _method(dtype)
        module.method.process_weights_after_loading(module, codes)
    return resolved
