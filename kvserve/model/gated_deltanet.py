"""Gated DeltaNet (Qwen3.5's linear attention): the math and the layer.

Per value head h the layer keeps a matrix S (key_head_dim x value_head_dim) instead of a K/V cache. Each token
decays it by exp(g) (g = -exp(A_log) * softplus(a + dt_bias), per head), then writes the part of v that S does
not already predict from k (the delta rule, learning rate beta = sigmoid(b)), and reads it with q:

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q        (q, k L2-normalised; q scaled by dk^-0.5)

Before that a causal depthwise convolution (kernel_size taps, SiLU) mixes each q/k/v channel with its previous
inputs, so a request's state is (the convolution's last kernel - 1 inputs, S per value head): ModelConfig's
`recurrent_state`, kept in float32.

Every token runs the recurrence itself, prefill included (kvserve/kernels/csrc/gated_delta.cpp, token by
token, all of a step's sequences in one call reading and writing their state slots): a token's numbers are then
the same bits however its prompt was chunked, resumed from a snapshot or batched (README "Determinism"). The
chunked form (transformers' WY fallback) folds 64 tokens into matmuls, but its results depend on where a chunk
starts; on a CPU the sequential kernel costs about a sixth of the layer's projections per prefill token
(bench/gated_delta.py). The convolution sums its taps element by element in a fixed order for the same reason
(kvserve.model.short_conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import GatedDeltaNetShape
from kvserve.kernels import gated_delta
from kvserve.kv.state.context import StateContext
from kvserve.model.layers import Linear, MergedLinear, RMSNorm, new_parameter, per_row
from kvserve.model.short_conv import CausalDepthwiseConv


class GatedDeltaNet(nn.Module):
    """Qwen3.5's `linear_attn`: in-projections (q/k/v, the output gate z, beta's b and the decay's a, fused in
    one GEMM as `in_proj`, shards 0-3), the convolution, the delta rule per sequence from its state, RMSNorm
    of each head's output gated by SiLU(z), out-projection. Checkpoint names as Hugging Face's
    Qwen3_5GatedDeltaNet: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, A_log, dt_bias, norm, out_proj."""

    def __init__(self, shape: GatedDeltaNetShape, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.shape = shape
        self.key_size = shape.num_key_heads * shape.key_head_dim
        self.value_size = shape.num_value_heads * shape.value_head_dim
        heads = shape.num_value_heads
        self.in_proj = MergedLinear(hidden_size, [shape.conv_dim, self.value_size, heads, heads])
        self.conv1d = CausalDepthwiseConv(shape.conv_dim, shape.conv_kernel, bias=False)
        self.A_log = new_parameter(heads)
        self.dt_bias = new_parameter(heads)
        self.norm = RMSNorm(shape.value_head_dim, eps)
        self.out_proj = Linear(self.value_size, hidden_size)

    def forward(self, x: torch.Tensor, states: StateContext, layer: int) -> torch.Tensor:
        """x `[N, hidden]` (the step's rows of every sequence) -> `[N, hidden]`; `layer`: the recurrent layer's
        index among the model's, whose state each sequence reads and writes."""
        shape = self.shape
        heads = shape.num_value_heads
        mixed, z, b, a = self.in_proj(x).split([shape.conv_dim, self.value_size, heads, heads], dim=-1)
        g = -self.A_log.exp() * per_row(F.softplus, a + self.dt_bias)
        beta = per_row(torch.sigmoid, b)
        q, k, v = self._heads(per_row(F.silu, self._convolve(mixed, states, layer)))
        core = self._delta_rule(q, k, v, g, beta, states, layer)
        gate = per_row(F.silu, z).reshape(-1, shape.value_head_dim)
        gated = self.norm(core.reshape(-1, shape.value_head_dim)) * gate
        return self.out_proj(gated.view(x.shape[0], self.value_size))

    def _convolve(self, mixed: torch.Tensor, states: StateContext, layer: int) -> torch.Tensor:
        """The causal convolution of each sequence's rows from its history; histories (state tensor 0) written
        to its slots: after its last row, and after each snapshot's rows."""
        tensors = states.slot_tensors(layer)
        past = self.shape.conv_kernel - 1
        outputs = []
        for sequence in states.sequences:
            rows = mixed[sequence.first_row : sequence.first_row + sequence.num_rows]
            state = states.read(layer, sequence)
            out, (history,) = self.conv1d.run(rows, None if state is None else state[:1])
            outputs.append(out)
            if tensors is not None:
                extended = torch.cat((state[0].t() if state is not None else rows.new_zeros(past, rows.shape[1]),
                                      rows)) if sequence.snapshots else None
                for count, slot in sequence.snapshots:
                    tensors[0][slot].copy_(extended[count : count + past].t())
                tensors[0][sequence.slot].copy_(history)
        return torch.cat(outputs) if len(outputs) != 1 else outputs[0]

    def _delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: StateContext, layer: int) -> torch.Tensor:
        """Every sequence's rows from its matrices (state tensor 1), in one kernel call over the slots."""
        tensors = states.slot_tensors(layer)
        if tensors is None:  # one whole sequence, nothing kept
            return gated_delta.gated_delta_rule(q, k, v, g, beta)[0]
        plan = states.shared("delta_sequences", lambda: _plan(states))  # built once per step, not per layer
        return gated_delta.gated_delta_rule_slots_(q, k, v, g, beta, tensors[1], plan)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's outputs `[N, C]` -> q, k, v `[N, value heads, D]`, each value head beside the key
        head it reads (the kernel L2-normalises q and k and scales q by key_head_dim^-0.5)."""
        shape = self.shape
        rows = mixed.shape[0]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.reshape(rows, shape.num_key_heads, shape.key_head_dim)
        k = k.reshape(rows, shape.num_key_heads, shape.key_head_dim)
        return self._expand(q), self._expand(k), v.reshape(rows, shape.num_value_heads, shape.value_head_dim)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, key heads, D]` -> `[T, value heads, D]`: each value head gets the key head it reads."""
        repeats = self.shape.num_value_heads // self.shape.num_key_heads
        if repeats == 1:
            return x
        return x.repeat(1, repeats, 1) if self.shape.value_heads_tiled else x.repeat_interleave(repeats, dim=1)


def _plan(states: StateContext) -> gated_delta.DeltaSequences:
    """The kernel's view of a step's sequences: the same for every Gated DeltaNet layer of the step."""
    sequences = states.sequences
    return gated_delta.DeltaSequences.of(
        [sequence.num_rows for sequence in sequences],
        [sequence.read_slot if sequence.start else -1 for sequence in sequences],
        [sequence.slot for sequence in sequences],
        [(index, count, slot) for index, sequence in enumerate(sequences) for count, slot in sequence.snapshots])
