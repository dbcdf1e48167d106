"""The state slots' tensors: for every recurrent layer, each of its state tensors for every slot
(`[num_slots, *shape]`), and the step context that reads and writes them (kv/state/context.py).

A slot index names the same request's state in every recurrent layer. Which slot holds what (a request's
live state, a snapshot for prefix hits, a draft checkpoint) is the state manager's bookkeeping; this module
only moves tensors where the runner says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.kv.state.context import LayerState, StateContext, StateSequence
from kvserve.kv.state.state_spec import STATE_DTYPE, StateSpec


class StateCache:
    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError("a state cache has at least one slot")
        self.spec = spec
        self.num_slots = num_slots
        # Zeroed: a slot is always written before it is read, but a never-written one must not hold NaN.
        self.layers: list[list[torch.Tensor]] = [
            [torch.zeros(num_slots, *shape, dtype=STATE_DTYPE, device=device) for shape in spec.shapes]
            for _ in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.spec.slot_bytes

    def copy_slots(self, copies: Sequence[tuple[int, int]]) -> None:
        """(source, destination) slot pairs, in every layer; every source is read before any is written."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.layers[0][0].device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=src.device)
        for tensors in self.layers:
            for tensor in tensors:
                tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def context(self, sequences: Sequence[StateSequence]) -> SlotStateContext:
        return SlotStateContext(self, sequences)


class SlotStateContext(StateContext):
    """One forward's sequences over the cache's slots."""

    def __init__(self, cache: StateCache, sequences: Sequence[StateSequence]) -> None:
        super().__init__()
        self.cache = cache
        self.sequences = tuple(sequences)

    def read(self, layer: int, sequence: StateSequence) -> LayerState | None:
        if sequence.start == 0:
            return None
        return [tensor[sequence.read_slot] for tensor in self.cache.layers[layer]]

    def write(self, layer: int, slot: int, state: LayerState) -> None:
        for tensor, value in zip(self.cache.layers[layer], state):
            tensor[slot].copy_(value)

    def slot_tensors(self, layer: int) -> list[torch.Tensor]:
        return self.cache.layers[layer]
