"""LFM2's double-gated short convolution: the recurrent layer of its hybrid stack.

`in_proj` gives three streams B, C and x of the hidden width; B * x runs through a depthwise causal
convolution of `kernel` taps (each channel its own filter over its last `kernel` values), C gates what comes
out, and `out_proj` mixes it back. What a request carries from token to token is the convolution's window:
each channel's last `kernel - 1` inputs (`[hidden, kernel - 1]`, float32), ModelConfig.recurrent_state.

A segment of rows runs as one convolution over [its window ++ the rows] (`kernel` vectorized multiply-adds
over the whole segment, no loop over tokens); a single row (decode) is the same computation on one row, the
update step. Both give the outputs and window a whole sequence would, to the bit, wherever it is split
(scan_sequences splits it at snapshots).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.kv.state.context import LayerState, StateContext, scan_sequences
from kvserve.kv.state.state_spec import STATE_DTYPE
from kvserve.model.layers import Linear, default_weight_loader, new_parameter


class CausalDepthwiseConv(nn.Module):
    """y[t, c] = sum_j weight[c, j] * u[t - (kernel - 1) + j, c] (+ bias[c]), u before the sequence zero."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        if kernel < 2:
            raise ValueError(f"a short convolution keeps kernel - 1 inputs: its kernel must be >= 2, got {kernel}")
        self.kernel = kernel
        self.weight = new_parameter(channels, kernel, weight_loader=self._load_weight)
        self.bias = new_parameter(channels) if bias else None

    @staticmethod
    def _load_weight(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        # transformers holds nn.Conv1d's `[channels, 1, kernel]`; llama.cpp's converter squeezes it to 2-D.
        if loaded.dim() == 3 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        default_weight_loader(param, loaded, shard_id)

    def run(self, rows: torch.Tensor, state: LayerState | None) -> tuple[torch.Tensor, LayerState]:
        """One sequence's consecutive rows `[T, channels]` from its window (None: zeros) -> their outputs
        `[T, channels]` and the window after them. A Recurrence for scan_sequences.

        The taps are summed element by element in a fixed order over [window ++ rows], not by a convolution
        kernel whose summation order may depend on T: a row's output is then the same bits whether it came in
        a prefill chunk, a batch or a decode step (README "Determinism"), at kernel multiply-adds per row.
        """
        past = self.kernel - 1
        window = rows.new_zeros(past, rows.shape[1], dtype=STATE_DTYPE) if state is None else state[0].t()
        extended = torch.cat([window, rows.to(STATE_DTYPE)])  # [past + T, channels]: new, the cache's untouched
        count = rows.shape[0]
        out = extended[0:count] * self.weight[:, 0]
        for tap in range(1, self.kernel):
            out = out + extended[tap : tap + count] * self.weight[:, tap]
        if self.bias is not None:
            out = out + self.bias
        return out.to(rows.dtype), [extended[-past:].t()]


class ShortConv(nn.Module):
    """out_proj(C * conv(B * x)) with B, C, x = in_proj(input); `state_layer`: its index among the model's
    recurrent layers (where its window lives in the state context)."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, state_layer: int) -> None:
        super().__init__()
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = CausalDepthwiseConv(hidden_size, kernel, bias)
        self.out_proj = Linear(hidden_size, hidden_size, bias=bias)
        self.state_layer = state_layer

    def forward(self, x: torch.Tensor, states: StateContext) -> torch.Tensor:
        b, c, inputs = self.in_proj(x).chunk(3, dim=-1)
        convolved = scan_sequences(states, self.state_layer, b * inputs, self.conv.run)
        return self.out_proj(c * convolved)
