"""Gated DeltaNet (Qwen3.5's linear attention): the math and the layer.

Per value head h the layer keeps a matrix S (key_head_dim x value_head_dim) instead of a K/V cache. Each token
decays it by exp(g) (g = -exp(A_log) * softplus(a + dt_bias), per head), then writes the part of v that S does
not already predict from k (the delta rule, learning rate beta = sigmoid(b)), and reads it with q:

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q        (q, k L2-normalised; q scaled by dk^-0.5)

Before that a causal depthwise convolution (kernel_size taps, SiLU) mixes each q/k/v channel with its previous
inputs, so a request's state is (the convolution's last kernel - 1 inputs, S per value head): ModelConfig's
`recurrent_state`, kept in float32.

A segment of several rows (a prefill chunk) runs the chunked form (`chunked_gated_delta_rule`): within each
chunk of 64 tokens the updates are folded into a triangular solve and matmuls (the WY / UT form of the delta
rule, as in flash-linear-attention and transformers' torch fallback), and only the chunks run in sequence. One
row (decode) runs the step itself (`gated_delta_step`), a decode step's sequences batched in one call. The two
agree to float32 rounding (not bit for bit), and a sequence run whole or in pieces from its saved state gives
the same outputs to rounding (tests/model/test_qwen35.py); a row's numbers do not depend on the other requests
beside it in a step, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import GatedDeltaNetShape
from kvserve.kv.state.context import LayerState, StateContext, scan_sequences
from kvserve.model.layers import Linear, MergedLinear, RMSNorm, new_parameter, per_row

CHUNK_SIZE = 64
_L2_EPS = 1e-6  # as flash-linear-attention's l2norm
def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x `[N, ...]` / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * per_row(torch.rsqrt, (x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k `[H, Dk]`, v `[H, Dv]`, g (log decay), beta `[H]`, state `[H, Dk, Dv]` (None: zeros)
    -> (out `[H, Dv]`, the new state). `state` is not changed."""
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[1], v.shape[1])
    decay = per_row(torch.exp, g[:, None])[:, 0]  # one head per row: its own vector run, whatever the batch
    predicted = torch.bmm(k[:, None, :], state)[:, 0] * decay[:, None]  # k . (decayed S), without S decayed first
    correction = (v - predicted) * beta[:, None]
    updated = torch.baddbmm(state * decay[:, None, None], k[:, :, None], correction[:, None, :])
    return torch.bmm(q[:, None, :], updated)[:, 0], updated


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + lower)^-1 for strictly lower triangular `lower` `[..., n, n]`: I - L + L^2 - ... (L is nilpotent, so
    the series ends at L^(n-1)), as the product (I - L)(I + L^2)(I + L^4)... in log2(n) squarings. Batched
    matmuls: torch's batched triangular solve runs one small LAPACK call per matrix, 7x slower here."""
    size = lower.shape[-1]
    power = -lower
    inverse = power + torch.eye(size, dtype=lower.dtype, device=lower.device)
    covered = 2  # the powers 0 .. covered - 1 are summed
    while covered < size:
        power = power @ power
        inverse = inverse + inverse @ power
        covered *= 2
    return inverse


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor | None,
                             chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens at once: q, k `[T, H, Dk]`, v `[T, H, Dv]`, g, beta `[T, H]`, state `[H, Dk, Dv]` (None: zeros)
    -> (out `[T, H, Dv]`, the state after the last token); what T calls of `gated_delta_step` give."""
    num_tokens, num_heads, key_dim = k.shape
    value_dim = v.shape[-1]
    size = min(chunk_size, num_tokens)
    pad = -num_tokens % size
    # [H, T, ...], padded with tokens that neither decay (g = 0) nor write (k = v = beta = 0) the state
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.transpose(0, 1), (0, pad)) for t in (g, beta))
    chunks = (num_tokens + pad) // size
    q, k, v = (t.reshape(num_heads, chunks, size, -1) for t in (q, k, v))
    g, beta = (t.reshape(num_heads, chunks, size) for t in (g, beta))

    decay_in = g.cumsum(dim=-1)  # log of the decay from the chunk's start through each token
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j]: from token j to token i of a chunk (j <= i), 0 above the diagonal
    decay = (decay_in[..., :, None] - decay_in[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # The chunk's updates as one unit lower-triangular system (I + strictly_lower(beta_i k_i.k_j decay_ij)):
    # solved (its inverse, once) for the values written and for the keys that read the chunk's incoming state.
    solve = unit_lower_inverse(((k_beta @ k.transpose(-1, -2)) * decay).tril(-1))
    written = solve @ (v * beta[..., None])
    reads_state = solve @ (k_beta * decay_in.exp()[..., None])
    within = (q @ k.transpose(-1, -2)) * decay  # each token's attention to the chunk's tokens up to itself
    q_decayed = q * decay_in.exp()[..., None]
    k_to_end = k * (decay_in[..., -1:] - decay_in).exp()[..., None]
    chunk_decay = decay_in[..., -1].exp()

    state = q.new_zeros(num_heads, key_dim, value_dim) if state is None else state
    out = q.new_empty(num_heads, chunks, size, value_dim)
    for c in range(chunks):
        new_values = written[:, c] - reads_state[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + within[:, c] @ new_values
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ new_values
    out = out.reshape(num_heads, chunks * size, value_dim)[:, :num_tokens]
    return out.transpose(0, 1), state


class DepthwiseConv1d(nn.Module):
    """Causal depthwise convolution over time with SiLU: each channel mixes its last `kernel_size` inputs.
    Checkpoint name `weight` `[channels, 1, kernel_size]` (torch's Conv1d layout, as Hugging Face stores it)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(channels, 1, kernel_size)

    def forward(self, x: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment: x `[T, C]` (one sequence's rows), history `[C, kernel - 1]` (its previous inputs; None:
        zeros) -> (outputs `[T, C]`, the new history). `history` is not changed."""
        channels, _, kernel = self.weight.shape
        if history is None:
            history = x.new_zeros(channels, kernel - 1)
        window = torch.cat((history, x.T), dim=1)  # [C, kernel - 1 + T]
        mixed = F.conv1d(window[None], self.weight, groups=channels)[0].T
        return F.silu(mixed), window[:, window.shape[1] - (kernel - 1):]

    def step(self, x: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row of each of B sequences: x `[B, C]`, history `[B, C, kernel - 1]` -> (outputs `[B, C]`, the new
        histories): one dot product per channel. `history` is not changed."""
        window = torch.cat((history, x[:, :, None]), dim=2)  # [B, C, kernel]
        return per_row(F.silu, (window * self.weight[:, 0]).sum(dim=-1)), window[:, :, 1:]


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
        self.conv1d = DepthwiseConv1d(shape.conv_dim, shape.conv_kernel)
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
        rows = torch.cat((mixed, g, per_row(torch.sigmoid, b)), dim=-1)
        sequences = states.sequences
        if all(sequence.num_rows == 1 and not sequence.snapshots for sequence in sequences):
            core = self._decode(rows, states, layer)  # every sequence one row: one batched step
        else:
            core = scan_sequences(states, layer, rows, self.recurrence)
        gate = per_row(F.silu, z).reshape(-1, shape.value_head_dim)
        gated = self.norm(core.reshape(-1, shape.value_head_dim)) * gate
        return self.out_proj(gated.view(x.shape[0], self.value_size))

    def recurrence(self, rows: torch.Tensor, state: LayerState | None) -> tuple[torch.Tensor, LayerState]:
        """One sequence's consecutive rows (projected, `forward`'s per_row) from its state -> (each row's output
        `[T, value heads * value_head_dim]`, the state after them)."""
        if rows.shape[0] == 1:  # the same computation as a decode batch's row
            out, history, matrix = self._steps(rows, [state])
            return out, [history[0], matrix[0]]
        shape = self.shape
        heads = shape.num_value_heads
        mixed, g, beta = rows.split([shape.conv_dim, heads, heads], dim=-1)
        history, matrix = (None, None) if state is None else state
        mixed, history = self.conv1d(mixed, history)
        q, k, v = self._heads(mixed)
        out, matrix = chunked_gated_delta_rule(q, k, v, g, beta, matrix)
        return out.reshape(rows.shape[0], self.value_size), [history, matrix]

    def _decode(self, per_row: torch.Tensor, states: StateContext, layer: int) -> torch.Tensor:
        """Every sequence's one row at once from its state, each new state written back. (Sequences come in row
        order, so with one row each, sequence i's row is row i.)"""
        sequences = states.sequences
        out, history, matrix = self._steps(per_row, [states.read(layer, sequence) for sequence in sequences])
        for i, sequence in enumerate(sequences):
            states.write(layer, sequence.slot, [history[i], matrix[i]])
        return out

    def _steps(self, rows: torch.Tensor, starts: list[LayerState | None]) -> tuple[torch.Tensor, ...]:
        """One row of each of B sequences from their states -> (outputs `[B, value size]`, the conv histories
        `[B, C, kernel - 1]`, the matrices `[B, heads, Dk, Dv]` after them)."""
        shape = self.shape
        heads, channels = shape.num_value_heads, shape.conv_dim
        mixed, g, beta = rows.split([channels, heads, heads], dim=-1)
        if len(starts) == 1 and starts[0] is not None:  # one sequence: its state as it is (read, never written)
            history, matrix = starts[0][0][None], starts[0][1][None]
        else:
            history = torch.stack([rows.new_zeros(channels, shape.conv_kernel - 1) if state is None else state[0]
                                   for state in starts])
            matrix = torch.stack([rows.new_zeros(heads, shape.key_head_dim, shape.value_head_dim) if state is None
                                  else state[1] for state in starts])
        mixed, history = self.conv1d.step(mixed, history)
        q, k, v = self._heads(mixed)
        out, matrix = gated_delta_step(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(),
                                       beta.flatten(), matrix.flatten(0, 1))
        return out.reshape(rows.shape[0], self.value_size), history, matrix.view(-1, heads, *matrix.shape[1:])

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's outputs `[N, C]` -> q, k (L2-normalised, q scaled by key_head_dim^-0.5), v
        `[N, value heads, D]`, each value head beside the key head it reads."""
        shape = self.shape
        rows = mixed.shape[0]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = l2_normalize(q.reshape(rows, shape.num_key_heads, shape.key_head_dim)) * shape.key_head_dim**-0.5
        k = l2_normalize(k.reshape(rows, shape.num_key_heads, shape.key_head_dim))
        return self._expand(q), self._expand(k), v.reshape(rows, shape.num_value_heads, shape.value_head_dim)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, key heads, D]` -> `[T, value heads, D]`: each value head gets the key head it reads."""
        repeats = self.shape.num_value_heads // self.shape.num_key_heads
        if repeats == 1:
            return x
        return x.repeat(1, repeats, 1) if self.shape.value_heads_tiled else x.repeat_interleave(repeats, dim=1)
