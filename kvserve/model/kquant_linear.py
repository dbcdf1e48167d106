"""Linear layers whose weights are a GGUF file's K-quant matrices (Q4_K, Q5_K, Q6_K), held as the file's own
codes, scales and mins (kvserve/kernels/kquant_packing.py) and multiplied by the C++ K-quant matmul
(kernels/csrc/kquant_matmul.cpp): the weights are exactly the file's, at about the file's bytes (Q4_K 4.6
bits a weight held, where int8 groups took 9), and a row's result never depends on the rows beside it.

A fused projection (QKV, gate-up) whose shards are each of their own K-quant type (a Q4_K_M file keeps
some V and down projections in Q6_K) holds one packed matrix per shard, each writing its columns of the
one output in one kernel call (one quantization of x, one parallel region).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.kernels.kquant_packing import KQUANT_KINDS, KQuantCodes, pack_kquant
from kvserve.model.layers import Linear, UnquantizedLinearMethod


class KQuantLinearMethod(UnquantizedLinearMethod):
    """One packed K-quant matrix per row block of the layer (`parts`, in row order); nothing else is kept."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, int, int]] = []  # (kind number, first output, outputs), in row order

    def process_weights_after_loading(self, layer: Linear, source: list[KQuantCodes] | None = None) -> None:
        if not source:
            raise ValueError("a K-quant layer is built from its checkpoint's K-quant matrices")
        if sum(part.shape[0] for part in source) != layer.output_size:
            raise ValueError(f"K-quant parts of {[p.shape for p in source]} do not make a layer of "
                             f"{layer.output_size} outputs")
        column = 0
        for index, part in enumerate(source):
            if part.shape[1] != layer.input_size:
                raise ValueError(f"a {part.kind} matrix of {part.shape[1]} inputs in a layer of {layer.input_size}")
            setattr(layer, f"packed_{index}", nn.Parameter(pack_kquant(part), requires_grad=False))
            self.parts.append((KQUANT_KINDS[part.kind], column, part.shape[0]))
            column += part.shape[0]
        layer.weight = None  # a tied head only lets go of the embedding's tensor

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        parts = [ops.KQuantPart(getattr(layer, f"packed_{index}"), kind, column, outputs)
                 for index, (kind, column, outputs) in enumerate(self.parts)]
        y = ops.kquant_matmul_parts(rows, parts, torch.empty(rows.shape[0], layer.output_size, dtype=torch.float32))
        if layer.bias is not None:
            y += layer.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], layer.output_size)
