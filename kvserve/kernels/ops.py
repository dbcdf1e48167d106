"""The one door to kvserve's C++ extension: every call into it goes through a function here (the gated
delta rule's through kernels/gated_delta.py, which holds its torch path too).

Each function checks what the kernel needs (CPU tensors of the dtypes it reads) before calling it: a
tensor elsewhere (a CUDA tensor would be read as host memory) or of another dtype either takes the torch
path, where there is one (the per-layer ops: both give the same math in fp32 and the tests hold them to
each other), or raises `KernelInputError` naming the argument, where there is none (the quantized matmul,
paged decode). The checks are attribute reads: the kernels stay on the hot path at their own cost. The
kernel does each op in one pass over its rows instead of a chain of dispatched torch ops, which is most
of a batch-1 decode step's overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvserve.kernels.build import cpu_kernels as kernels  # the compiled kernels, or None

SILU, GELU_TANH = 0, 1  # gated_activation's activations (the C++ enum)
# Cache dtypes the paged decode and the K/V store read and write (16-bit ones widened / narrowed per row).
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelInputError(ValueError):
    """A tensor the C++ kernel cannot take (wrong device or dtype): raised before the call, never a crash."""


def available() -> bool:
    """Whether the C++ kernels are built here (built or loaded on the first call)."""
    return kernels() is not None


def quant_matmul_isa() -> str | None:
    """The instruction set the quantized matmul runs on here ("avx512_vnni", "avx2", "portable"), or None
    where the C++ kernels are not built."""
    ext = kernels()
    return None if ext is None else ext.quant_matmul_isa()


_F32, _LONG, _BOOL, _U8 = torch.float32, torch.long, torch.bool, torch.uint8


# The one rule by which the per-layer ops choose the kernel over torch: the extension is built and takes
# every tensor as it is. Plain attribute reads, no containers: these run ~150 times per decode step.
def _rows(x: torch.Tensor) -> bool:
    """Whether the kernel takes x as it is: CPU fp32 rows with a contiguous last dimension."""
    return x.is_cpu and x.dtype is _F32 and x.dim() == 2 and x.stride(1) == 1


def _cpu_fp32(x: torch.Tensor) -> bool:
    """Whether the kernel reads x (a weight, a RoPE table) as it is: CPU fp32, any layout."""
    return x.is_cpu and x.dtype is _F32


def _refuse(op: str, ext: ModuleType | None, **tensors: tuple[torch.Tensor, tuple[torch.dtype, ...]]) -> None:
    """Raise KernelInputError naming the first tensor `op`'s kernel cannot take (called once a check failed)."""
    if ext is None:
        raise KernelInputError(f"{op} needs kvserve's C++ kernels, which are not built here")
    for name, (tensor, dtypes) in tensors.items():
        if not tensor.is_cpu:
            raise KernelInputError(f"{op}: {name} is on {tensor.device}; the C++ kernel reads CPU tensors only")
        if tensor.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise KernelInputError(f"{op}: {name} is {str(tensor.dtype).removeprefix('torch.')}, expected {names}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[T, H]` / rms(x) * weight."""
    ext = kernels()
    if ext is not None and _rows(x) and _cpu_fp32(weight):
        return ext.rms_norm(x, weight, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place); returns rms_norm(residual)."""
    ext = kernels()
    if ext is not None and _rows(residual) and _rows(delta) and _cpu_fp32(weight):
        return ext.add_rms_norm_(residual, delta, weight, eps)
    residual.add_(delta)
    return F.rms_norm(residual, residual.shape[-1:], weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row of x `[T, >= heads * head_dim]`
    (a fused QKV output's Q and K lie side by side); cos, sin `[T, rotary_dim]`: the first rotary_dim
    channels of each head rotate (partial RoPE where rotary_dim < head_dim; the kernel rotates whole heads)."""
    ext = kernels()
    if ext is not None and _rows(x) and _cpu_fp32(cos) and _cpu_fp32(sin) and cos.shape[-1] == head_dim:
        ext.rope_(x, cos, sin, heads, head_dim)
        return
    rotated = x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)
    rotated.copy_(apply_rope(rotated, cos, sin))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`, cos/sin `[T, R]` (rotate-half layout, as in Hugging Face): the first R <= D channels
    of each head rotated, the others kept; a new tensor."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


def gated_activation(x: torch.Tensor, activation: int) -> torch.Tensor:
    """x `[T, 2I]` (gate, then up) -> act(gate) * up `[T, I]`; SILU or GELU_TANH."""
    ext = kernels()
    if ext is not None and _rows(x):
        return ext.gated_activation(x, activation)
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) if activation == SILU else F.gelu(gate, approximate="tanh")) * up


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> bool:
    """New tokens' K, V `[T, KVH, D]` (fp32) into float cache rows `[rows, D]` at `slots` (`[T * KVH]`), cast
    to the cache's dtype, in one pass; False (nothing written: the caller's torch path) where the kernel is
    not built or does not take these tensors (off the CPU, another dtype, strided rows)."""
    ext = kernels()
    if (ext is None or not (k.is_cpu and v.is_cpu and slots.is_cpu and k_cache.is_cpu and v_cache.is_cpu)
            or k.dtype is not _F32 or v.dtype is not _F32 or slots.dtype is not _LONG
            or k_cache.dtype not in CACHE_DTYPES or k.stride(-1) != 1 or v.stride(-1) != 1):
        return False
    ext.store_kv_(k_cache, v_cache, slots, k, v)
    return True


def quant_matmul(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int, isa: int = -1,
                 table: torch.Tensor | None = None, runs: int = 0, zero: int | None = None) -> torch.Tensor:
    """x `[M, K]` fp32 @ W^T -> `[M, out_features]` for W packed as `bits`-bit groups (kernels/packing.py);
    `table` (uint8 `[16]`, values below 128): what each 4-bit code stands for (GroupCodes.table); `zero`:
    the codes' zero point where every offset is -zero * scale (packing.zero_point), packed without their
    offsets (`pack(codes, offsets=False)`) and folded into the integer dot products instead (one multiply-add
    fewer per group and row). `isa`: -1
    the best this CPU has; 0 / 1 / 2 force portable / AVX2 / AVX512-VNNI (tests). `runs`: how many weight
    tiles a decode batch of up to 4 rows (AVX2: 3) reads side by side: 1, 2 or 4 for one row, 1 or 2
    (4 taken as 2) for more; 0 the kernel's choice (on AVX2 one; tests and bench/matmul_runs.py compare
    them: the same bits, another speed). No torch path: a layer holds these weights only where the kernel
    is built."""
    ext = kernels()
    if ext is None or not (x.is_cpu and packed.is_cpu and x.dtype is _F32 and packed.dtype is _U8):
        _refuse("quant_matmul", ext, x=(x, (_F32,)), packed=(packed, (_U8,)))
    return ext.quant_matmul(x, packed, bits, out_features, isa, _NO_U8 if table is None else table, runs,
                            -1 if zero is None else zero)


def kquant_matmul(x: torch.Tensor, packed: torch.Tensor, kind: int, out_features: int,
                  out: torch.Tensor | None = None, column: int = 0, isa: int = -1) -> torch.Tensor:
    """x `[M, K]` fp32 @ W^T for W a GGUF K-quant matrix packed by kernels/kquant_packing.py (`kind`: its
    KQUANT_KINDS number), written to `out[:, column : column + out_features]` or to a new
    `[M, out_features]`; returns the output. `isa` as for `quant_matmul`."""
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=_F32)
    return kquant_matmul_parts(x, [KQuantPart(packed, kind, column, out_features)], out, isa)


class KQuantPart(NamedTuple):
    """One row block of a K-quant layer: its packed matrix, kind number, first output column and outputs."""

    packed: torch.Tensor
    kind: int
    column: int
    outputs: int


def kquant_matmul_parts(x: torch.Tensor, parts: Sequence[KQuantPart], out: torch.Tensor,
                        isa: int = -1) -> torch.Tensor:
    """`kquant_matmul` for a fused projection whose row blocks are each of their own K-quant type (a Q4_K_M
    file's Q6_K V rows): every part writes its columns of `out` from one quantization of x, in one call."""
    ext = kernels()
    if ext is None or not (x.is_cpu and x.dtype is _F32 and all(p.packed.is_cpu and p.packed.dtype is _U8
                                                                 for p in parts)):
        _refuse("kquant_matmul", ext, x=(x, (_F32,)), **{"packed" if len(parts) == 1 else f"packed {i}":
                                                         (p.packed, (_U8,)) for i, p in enumerate(parts)})
    if not (out.is_cpu and out.dtype is _F32):
        _refuse("kquant_matmul", ext, out=(out, (_F32,)))
    ext.kquant_matmul_(x, [p.packed for p in parts], [p.kind for p in parts], [p.outputs for p in parts], out,
                       [p.column for p in parts], isa)
    return out


def kquant_repack(blocks: torch.Tensor, kind: int) -> torch.Tensor | None:
    """A GGUF matrix's K-quant super-blocks uint8 `[rows, supers, type bytes]` -> the layout `kquant_matmul`
    reads (kernels/kquant_packing.py's `pack_kquant`, which falls back to its torch reference on None: the
    kernels are not built here)."""
    ext = kernels()
    if ext is None:
        return None
    return ext.kquant_repack(blocks.contiguous(), kind)


class RowTables(NamedTuple):
    """Which keys each query row of the paged attention kernels sees (int64, CPU): row i at position
    row_pos[i] sees keys row_low[i]..row_pos[i] (row_low: its window's first key, else 0), block j of them
    at tables[row_table[i] + j]; the rows of one request share its table."""

    tables: torch.Tensor
    row_table: torch.Tensor
    row_low: torch.Tensor
    row_pos: torch.Tensor


# The kernels' "none" for optional tensors: made once, not once per call (every layer of every step passes them).
_NO_F32, _NO_F16, _NO_LONG, _NO_U8 = (torch.empty(0, dtype=dtype, device="cpu")
                                     for dtype in (torch.float32, torch.float16, torch.long, torch.uint8))


def _sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks argument: fp32 `[H]` on the CPU, or empty for none."""
    if sinks is None:
        return _NO_F32
    if not sinks.is_cpu or sinks.numel() != q.shape[1]:
        raise KernelInputError(f"sinks must be one CPU logit per query head ({q.shape[1]}), got {tuple(sinks.shape)} "
                               f"on {sinks.device}")
    return sinks.to(_F32)


def _cpu_longs(rows: RowTables) -> bool:
    return all(t.is_cpu and t.dtype is _LONG for t in rows)


def _row_checks(rows: RowTables) -> dict[str, tuple[torch.Tensor, tuple[torch.dtype, ...]]]:
    return {name: (tensor, (_LONG,)) for name, tensor in rows._asdict().items()}


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: RowTables, scale: float,
                 split_blocks: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention (csrc/paged_decode.cpp) over the float blocks, read in place, one query token per row
    (a decode, a verify's query, a prefill chunk's token): q `[B, H, D]` fp32, caches `[num_blocks, KVH,
    block_size, D]` -> `[B, H * D]`; `rows` says which keys each row sees (RowTables). Each row's blocks run
    in splits of `split_blocks` (<= 0: one), merged in order: a row's result depends on that row alone, not
    on the rows beside it. `sinks` (fp32 `[H]`): each head's learned logit in its softmax denominator
    (gpt-oss), once per row. No torch path here: the attention
    backend gathers the blocks and runs its torch kernels instead (kv/attention/cpu_decode.py)."""
    ext = kernels()
    if (ext is None or not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and _cpu_longs(rows))
            or q.dtype is not _F32 or k_cache.dtype not in CACHE_DTYPES or v_cache.dtype not in CACHE_DTYPES):
        _refuse("paged_decode", ext, q=(q, (_F32,)), k_cache=(k_cache, CACHE_DTYPES), v_cache=(v_cache, CACHE_DTYPES),
                **_row_checks(rows))
    return ext.paged_decode(q, k_cache, v_cache, *rows, scale, split_blocks, _sinks(sinks, q))


def decoder_stack(linears: Sequence[tuple[list[torch.Tensor], list[int], list[int], list[int], int,
                                           torch.Tensor | None, torch.Tensor | None, int, int | None]],
                  norms: Sequence[torch.Tensor], heads: int, kv_heads: int, head_dim: int, eps: float,
                  activation: int) -> object:
    """A Llama-family decoder's layers for `decoder_stack_forward_` (csrc/decoder_stack.cpp): per layer its
    QKV, O, gate-up and down projections (packed parts, kinds: -1 group codes else a K-quant kind, first
    columns, outputs, bits, code table, bias, outputs in all, the group codes' zero point or None: as
    `quant_matmul` takes them) and its input and post-attention norm weights."""
    ext = kernels()
    if ext is None:
        raise KernelInputError("decoder_stack needs kvserve's C++ kernels, which are not built here")
    return ext.DecoderStack([ext.StackLinear(packed, kinds, columns, outputs, bits,
                                             _NO_U8 if table is None else table, _NO_F32 if bias is None else bias,
                                             out_features, -1 if zero is None else zero)
                             for packed, kinds, columns, outputs, bits, table, bias, out_features, zero in linears],
                            list(norms), heads, kv_heads, head_dim, eps, activation)


def decoder_stack_forward_(stack: object, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], slots: torch.Tensor,
                           rows: RowTables, scale: float, split_blocks: int) -> None:
    """x `[T, hidden]` fp32 (the residual stream, in place) through every layer of `stack`: each stores its
    new K, V at `slots` of its float cache and attends as `paged_decode` does; cos, sin `[T, head_dim]`."""
    # One pool's caches share a device and a dtype: its first layer's stand for all (no per-layer loop here).
    if not (_rows(x) and x.is_contiguous() and _cpu_fp32(cos) and _cpu_fp32(sin) and slots.is_cpu
            and slots.dtype is _LONG and _cpu_longs(rows) and k_caches[0].is_cpu and v_caches[0].is_cpu
            and k_caches[0].dtype in CACHE_DTYPES and v_caches[0].dtype is k_caches[0].dtype):
        raise KernelInputError("decoder_stack_forward_: CPU fp32 rows, RoPE tables and float caches, int64 slots")
    stack.forward_(x, cos.contiguous(), sin.contiguous(), k_caches, v_caches, slots, *rows, scale, split_blocks)


def decoder_stack_timing(stack: object, on: bool) -> None:
    """Have `stack` time each of its ops from now on (`on`) or stop; the counts restart."""
    stack.set_timing(on)


def decoder_stack_op_times(stack: object) -> list[float]:
    """Seconds `stack` spent in each op (kvserve.model.decoder_stack.STACK_OPS order) while timing, since the
    timing began or was last taken; the counts restart."""
    return stack.take_op_times()


# paged_decode_quant's kinds of quantized sides (kv/cache/quant.py's codecs; the C++ enum).
INT8_ROW, INT4_ROW, INT4_CHANNEL = 1, 2, 3
_F16 = torch.float16


def paged_decode_quant(q: torch.Tensor, k: tuple[torch.Tensor, torch.Tensor, int],
                       v: tuple[torch.Tensor, torch.Tensor, int], group: int,
                       open_blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, rows: RowTables,
                       scale: float, split_blocks: int, sinks: torch.Tensor | None = None,
                       own_blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`paged_decode` over quantized blocks, read in place: k and v are (data `[num_blocks, KVH, block_size,
    width]`, fp16 params `[num_blocks, KVH, block_size, params]`, kind: INT8_ROW, INT4_ROW with `group`
    channels per group, INT4_CHANNEL); `open_blocks` (fp16 K, V `[slots, KVH, block_size, D]`, int64
    slot per block, -1 where the pool holds it) or None. `own_blocks` (fp16 K, V `[n, KVH, block_size, D]`,
    int64 `[B]`): row b reads the block holding its position from index `[2][b]` of them (-1: as above), or
    None (kv/attention/cpu_own_blocks.py)."""
    ext = kernels()
    tensors = [q, k[0], k[1], v[0], v[1], *(open_blocks or ()), *(own_blocks or ())]
    if (ext is None or not all(t.is_cpu for t in tensors) or not _cpu_longs(rows) or q.dtype is not _F32
            or k[1].dtype is not _F16 or v[1].dtype is not _F16):
        _refuse("paged_decode_quant", ext, q=(q, (_F32,)), k_params=(k[1], (_F16,)), v_params=(v[1], (_F16,)),
                **_row_checks(rows), k_data=(k[0], (k[0].dtype,)), v_data=(v[0], (v[0].dtype,)))
        raise KernelInputError("paged_decode_quant reads CPU tensors only")
    none = (_NO_F16, _NO_F16, _NO_LONG)
    return ext.paged_decode_quant(q, k[0], k[1], k[2], v[0], v[1], v[2], group, *(open_blocks or none),
                                  *(own_blocks or none), *rows, scale, split_blocks, _sinks(sinks, q))
