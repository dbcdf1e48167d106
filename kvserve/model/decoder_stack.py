"""A Llama-family decoder's layers as one C++ call per step (kvserve/kernels/csrc/decoder_stack.cpp).

The layers' kernels are the same ones called in the same order on the same tensors, so every token's bits
are the same as the layers' own forward (tests/model/test_decoder_stack.py holds them to it); what goes is
the Python between the calls: on the embedded model a batch-1 decode step spent ~2 ms of ~8 there
(`bench/step_profile.py`), ~66 us a layer for ~11 kernel calls.

The stack is built once, on the first step that can use it, from the layers as loading converted them
(it holds their packed tensors, not copies). It runs where the model and the step both allow, else the
layers run one by one as before:
- the model: plain Llama-family layers (no per-layer variations of a family built on them), every
  projection held as group codes or K-quant super-blocks (int4 / int8 weights; not fp32 or bf16), RoPE
  over whole heads, the C++ kernels built;
- the step: the attention context's `plain_paged_step` (one KV group, a float cache, every row through
  the C++ paged decode, as a float cache runs prefill chunks' tokens too).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.kv.attention.base import PlainPagedStep
from kvserve.model.kquant_linear import KQuantLinearMethod
from kvserve.model.layers import Linear
from kvserve.model.quantized_linear import GroupQuantizedLinearMethod

# False runs the layers one by one even where the stack could (tests compare the two).
ENABLED = True

# What the stack's op timing splits a forward into (csrc/decoder_stack.h's StackOp, in order): the four
# projections, attention (paged decode), and the small ops (norms, RoPE, the K/V store, the gated
# activation, the residual add).
STACK_OPS = ("small ops", "qkv", "attention", "o", "gate_up", "down")

_GROUP_CODES = -1  # the C++ StackLinear's kind for group codes


def stack_linear(layer: Linear) -> tuple | None:
    """`layer`'s weights as `ops.decoder_stack` takes a projection, or None where it holds another format."""
    method = layer.method
    bias = None if layer.bias is None else layer.bias.detach()
    if type(method) is GroupQuantizedLinearMethod:
        return ([layer.packed], [_GROUP_CODES], [0], [layer.output_size], method.bits, method.table, bias,
                layer.output_size, method.zero)
    if type(method) is KQuantLinearMethod:
        kinds, columns, outputs = (list(values) for values in zip(*method.parts))
        packed = [getattr(layer, f"packed_{index}") for index in range(len(method.parts))]
        return packed, kinds, columns, outputs, 0, None, bias, layer.output_size, None
    return None


def build_decoder_stack(layers: nn.ModuleList, num_heads: int, num_kv_heads: int, head_dim: int,
                        eps: float) -> object | None:
    """The stack of `layers` (Llama DecoderLayers, already checked plain by the model), or None where a
    projection's format is not one the stack multiplies or the kernels are not built."""
    if not ops.available():
        return None
    linears, norms = [], []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        for projection in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            held = stack_linear(projection)
            if held is None:
                return None
            linears.append(held)
        norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
    return ops.decoder_stack(linears, norms, num_heads, num_kv_heads, head_dim, eps, layers[0].mlp.activation)


def run_stack(stack: object, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: PlainPagedStep,
              scale: float) -> None:
    """x `[T, hidden]` through every layer of `stack`, in place."""
    ops.decoder_stack_forward_(stack, x, cos, sin, step.k_caches, step.v_caches, step.slots, step.rows, scale,
                               step.split_blocks)


def time_stack_ops(stack: object, on: bool) -> None:
    """Time `stack`'s ops in its forwards from now on (`on`), or stop (bench/step_profile.py)."""
    ops.decoder_stack_timing(stack, on)


def stack_op_times(stack: object) -> dict[str, float]:
    """Seconds per op (STACK_OPS) that `stack`'s forwards spent while timed, since the last call."""
    return dict(zip(STACK_OPS, ops.decoder_stack_op_times(stack), strict=True))
