"""How many bytes one request's recurrent state takes: the ONE formula for the state kind (as kv_spec is for K/V).

A recurrent layer keeps the same tensors whatever the request's length (ModelConfig.recurrent_state), in
float32: a recurrence accumulates over every token, so its state is kept at full precision (transformers
and llama.cpp keep it so too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig

STATE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class StateSpec:
    num_layers: int  # recurrent layers
    shapes: tuple[tuple[int, ...], ...]  # one layer's state tensors

    @property
    def bytes_per_layer(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes) * STATE_DTYPE.itemsize

    @property
    def slot_bytes(self) -> int:
        """One request's state over every recurrent layer: what a live state or a snapshot takes."""
        return self.num_layers * self.bytes_per_layer

    def formula(self) -> str:
        """e.g. '18 recurrent layers x (6,144 x 3 + 16 x 128 x 128) x 4 B = 20,201,472 bytes/state'."""
        tensors = " + ".join(" x ".join(f"{n:,}" for n in shape) for shape in self.shapes)
        return (f"{self.num_layers} recurrent layers x ({tensors}) x {STATE_DTYPE.itemsize} B "
                f"= {self.slot_bytes:,} bytes/state")


def state_spec(config: ModelConfig) -> StateSpec | None:
    """The recurrent state of a hybrid model; None for a model whose every layer attends."""
    layers = config.recurrent_layers
    return StateSpec(len(layers), tuple(tuple(shape) for shape in config.recurrent_state)) if layers else None
