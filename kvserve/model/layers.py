"""Building blocks the model families share: linear layers, RMSNorm, rotary embedding, gated MLP.

Every parameter that comes from a checkpoint carries a
`weight_loader(param, tensor, shard_id=None)`: the loader streams each
checkpoint tensor into its parameter through it (kvserve.model.weights).
Fused layers (Q/K/V, gate/up) take one checkpoint tensor per shard and write
it into the shard's rows, so fusion costs no concatenated copy at load time.

A linear layer owns a `LinearMethod` that decides how its weight is stored
(created), filled (loaded), converted once loaded, and multiplied (applied).
Checkpoints load as fp32; the bf16 / int8 / packed-int4 methods
(kvserve.model.quantized_linear) convert each layer after loading, and the
model code does not change.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig, RopeScaling
from kvserve.kernels import ops
from kvserve.kernels.packing import GroupCodes
from kvserve.model import rope_scaling
from kvserve.model.float_gemm import row_invariant_linear
from kvserve.model.rope_table import RopeTable


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (rows) it is loaded into."""

    def __init__(self, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"shape {actual}, expected {expected}")
        self.actual = actual
        self.expected = expected


def check_shape(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Raise WeightShapeError where `loaded` does not fit `target`."""
    if tuple(loaded.shape) != tuple(target.shape):
        raise WeightShapeError(tuple(loaded.shape), tuple(target.shape))


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `target` (casting to its dtype) after checking the shapes agree."""
    check_shape(target, loaded)
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """The whole parameter from one checkpoint tensor."""
    if shard_id is not None:
        raise ValueError(f"this parameter has no shards (got shard {shard_id!r})")
    copy_checked(param.data, loaded)


def new_parameter(*shape: int, dtype: torch.dtype = torch.float32,
                  weight_loader: Callable[..., None] | None = default_weight_loader) -> nn.Parameter:
    """An uninitialized (inference-only) parameter; with a weight loader it is filled from the checkpoint.

    A parameter without one (e.g. a quantized weight's scales) is filled by
    the loader of the parameter it belongs to, and is not a checkpoint name.
    """
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    if weight_loader is not None:
        param.weight_loader = weight_loader
    return param


# --- linear layers -----------------------------------------------------------------------------


class LinearMethod(abc.ABC):
    """How a linear layer holds and multiplies its weight. Stateless: the tensors live on the layer."""

    @abc.abstractmethod
    def create_weights(self, layer: Linear, input_size: int, output_size: int, bias: bool) -> None:
        """Register `layer.weight` (and `layer.bias`, or None) plus any tensors the format needs."""

    @abc.abstractmethod
    def load(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, rows: slice) -> None:
        """Write checkpoint tensor `loaded` (logical rows `rows` of `param`) in this format."""

    @abc.abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x `[N, input_size]` -> `[N, output_size]`."""

    def process_weights_after_loading(self, layer: Linear, source: GroupCodes | None = None) -> None:
        """Turn the loaded weight into this format's tensors (kvserve.model.quantized_linear); fp32 keeps it.
        `source`: the checkpoint's own group codes for this weight, where it has them (a GGUF Q4_1 file)."""


class UnquantizedLinearMethod(LinearMethod):
    """fp32 weights multiplied by `F.linear`: exactly what `nn.Linear` does, no copy, no cast."""

    def create_weights(self, layer: Linear, input_size: int, output_size: int, bias: bool) -> None:
        layer.weight = new_parameter(output_size, input_size, weight_loader=None)
        layer.bias = new_parameter(output_size, weight_loader=None) if bias else None

    def load(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, rows: slice) -> None:
        if loaded.is_meta:  # a shape only: the layer will hold the file's own codes (GGUFModel.weights)
            check_shape(param.data[rows], loaded)
        else:
            copy_checked(param.data[rows], loaded)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, layer.weight, layer.bias)  # kvserve.model.float_gemm


class Linear(nn.Module):
    """y = x W^T (+ b), with W held as `method` decides (fp32 by default)."""

    # Held in 8-bit groups where the others hold 4 (kvserve.model.quantized_linear), as the output head is: a
    # MoE router, whose top-k choice is discrete and would flip on 4-bit weights.
    keeps_8_bits: bool = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.set_method(method or UnquantizedLinearMethod())

    def set_method(self, method: LinearMethod) -> None:
        """(Re)create the weights in `method`'s format: on a meta-built model, before loading."""
        self.method = method
        self._parameters.clear()  # the previous method's tensors (a linear layer owns no others)
        method.create_weights(self, self.input_size, self.output_size, self.has_bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def shard_rows(self, shard_id: Any) -> slice:
        """The output rows a checkpoint shard fills."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards (got shard {shard_id!r})")
        return slice(0, self.output_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        self.method.load(self, param, loaded, self.shard_rows(shard_id))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class MergedLinear(Linear):
    """Projections of the same input stacked along the output rows: one GEMM instead of several.

    Shard i (0-based) is loaded into rows `sum(output_sizes[:i])` onwards.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, method)
        self.output_sizes = tuple(output_sizes)

    def shard_rows(self, shard_id: Any) -> slice:
        if shard_id is None:  # a checkpoint that stores the projections fused already (Phi-3)
            return slice(0, self.output_size)
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{type(self).__name__} has shards 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        start = sum(self.output_sizes[:shard_id])
        return slice(start, start + self.output_sizes[shard_id])


class QKVLinear(MergedLinear):
    """Q, K and V projections in one GEMM; shards "q", "k", "v" (K and V have the KV heads)."""

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, method)

    def shard_rows(self, shard_id: Any) -> slice:
        if shard_id is None:
            return super().shard_rows(None)
        if shard_id not in self.SHARDS:
            raise ValueError(f"QKVLinear has shards q, k, v, got {shard_id!r}")
        return super().shard_rows(self.SHARDS.index(shard_id))


# --- embedding, normalization, MLP --------------------------------------------------------------------------

# torch's elementwise CPU loops run two vectors (32 floats on AVX-512) at a time and the last few elements of a
# tensor on a scalar path, whose exp / sigmoid / rsqrt can differ from the vector path's by an ulp (README,
# Determinism): rows padded to whole runs of 32 always take the vector path, whatever rows are beside them.
_VECTOR_RUN = 32


def per_row(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise `function` of x `[N, ...]` whose every row comes out the same bits whatever N is (a
    request's numbers do not depend on the batch it runs in): each row padded to whole vector runs."""
    flat = x.reshape(x.shape[0], -1)
    width = flat.shape[1]
    if width % _VECTOR_RUN == 0:
        return function(x)
    return function(F.pad(flat, (0, -width % _VECTOR_RUN)))[:, :width].reshape(x.shape)



class VocabEmbedding(nn.Embedding):
    """Token embeddings: `nn.Embedding` without its random init, filled from the checkpoint."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size), _freeze=True)
        self.weight.weight_loader = default_weight_loader


class RMSNorm(nn.Module):
    """x / rms(x) * weight, over the last dimension.

    `weight_offset` is added to the checkpoint's weight as it loads: Gemma stores w and scales
    by (1 + w), so its norms load with offset 1 and then run like any other.
    """

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight_offset = weight_offset
        loader = self._load_offset if weight_offset else default_weight_loader
        self.weight = new_parameter(hidden_size, weight_loader=loader)
        self.eps = eps

    def _load_offset(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        # In fp32, as Gemma computes 1 + w (a bf16 checkpoint's w is widened first).
        default_weight_loader(param, loaded.float() + self.weight_offset, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place: the residual stream), then this norm of it, in one pass."""
        return ops.add_rms_norm_(residual, delta, self.weight, self.eps)


# A gated activation the fused kernel lacks: `[N, 2I]` (gate columns, then up) -> `[N, I]`.
GatedActivation = Callable[[torch.Tensor], torch.Tensor]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM (shards 0 and 1 of `gate_up_proj`);
    act is SiLU (Llama) or GELU's tanh form (Gemma): `ops.SILU` / `ops.GELU_TANH`, or a function of the whole
    gate/up output for an activation of its own (gpt-oss's clamped SwiGLU). `bias`: all three carry one."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: int | GatedActivation = ops.SILU,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if callable(self.activation):
            return self.down_proj(self.activation(gate_up))
        return self.down_proj(ops.gated_activation(gate_up, self.activation))


# --- rotary embedding ----------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling(),
                  freq_divisors: torch.Tensor | None = None, context_length: int | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies `[head_dim / 2]` with the scaling applied (always on CPU, even on a meta build);
    `head_dim`: the channels rotated. `context_length`: the model's, which LongRoPE's choice of set depends on."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if freq_divisors is not None:  # GGUF `rope_freqs`: llama.cpp's precomputed scaling
        return inv_freq / freq_divisors.to("cpu", torch.float32)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return rope_scaling.yarn_inv_freq(head_dim, theta, scaling)
    if scaling.rope_type == "longrope":
        context = context_length or scaling.original_max_position_embeddings
        return rope_scaling.longrope_inv_freq(head_dim, theta, scaling, context)
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # the band between interpolated smoothly.
        old_context = scaling.original_max_position_embeddings
        low_freq_wavelen = old_context / scaling.low_freq_factor
        high_freq_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for a step's positions (looked up once per step, shared by every layer).

    `head_dim` is the channels rotated: the first ones of each head (partial RoPE rotates fewer than the head
    has). YaRN and LongRoPE multiply cos and sin by their attention factor (rope_scaling.py).
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling = RopeScaling(),
                 context_length: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.context_length = context_length
        self.attention_factor = rope_scaling.attention_factor(scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling, context_length=context_length),
                             persistent=False)

    @classmethod
    def of(cls, config: ModelConfig) -> RotaryEmbedding:
        """A model's RoPE: its rotated channels, base, scaling and context."""
        return cls(config.rope_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)

    def load_longrope_factors(self, which: str, factors: torch.Tensor) -> None:
        """A GGUF file's LongRoPE factors (`which`: "short" or "long"), which its metadata does not hold."""
        values = tuple(float(f) for f in factors.reshape(-1).tolist())
        self.scaling = replace(self.scaling, **{f"{which}_factor": values})
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, context_length=self.context_length)

    def load_freq_divisors(self, divisors: torch.Tensor) -> None:
        """GGUF `rope_freqs` (Llama 3.1-style scaling as per-frequency divisors) replaces the config's scaling."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, divisors.reshape(-1))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` -> cos, sin `[T, head_dim]` (what `ops.rope_` and `ops.apply_rope` take), times the
        scaling's attention factor: looked up in a table kept by position (rope_table.py)."""
        return self._table().lookup(positions)

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of a pure rotation by `positions` (no attention factor, any sign): what moves cached keys."""
        return self._table().rotation(positions)

    def _table(self) -> RopeTable:
        """The table of inv_freq and the attention factor, made again whenever either is replaced (a GGUF's
        factors, a device move)."""
        cached = self.__dict__.get("_rope_table")
        if cached is None or cached[0] is not self.inv_freq or cached[1].factor != self.attention_factor:
            # The frequencies written twice: both halves of a head rotate by them.
            doubled = torch.cat((self.inv_freq, self.inv_freq))
            table = RopeTable(doubled, self.attention_factor, self.context_length)
            cached = self.__dict__["_rope_table"] = (self.inv_freq, table)
        return cached[1]

