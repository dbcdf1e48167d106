"""The recurrent-state seam: what a hybrid model's recurrent layers see for one forward.

An attention layer keeps K/V per token and reaches them through an `AttentionContext`. A recurrent layer
(Gated DeltaNet, a short convolution) keeps a fixed-size state per request instead, overwritten at every
token. Its forward sees a `StateContext`: the step's sequences (each request's rows, in batch order), where
each one's state starts and where it goes. A state lives in a *slot* of the state cache (every recurrent
layer has its tensors at the same slot index): the request's live slot holds the state after its computed
tokens; a snapshot slot keeps the state at some position for a later prefix hit or a draft's rollback.

The layer reads the live state (none at position 0: a fresh, all-zero state), runs its rows, and writes
the state back; where a sequence asks for snapshots, the state after that many of its rows is copied out
too (`scan_sequences` does all of that around a family's recurrence).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# A recurrent layer's state: its tensors, in the order of ModelConfig.recurrent_state (one request's, no batch
# dimension), or None for a fresh (all-zero) state.
LayerState = list[torch.Tensor]


@dataclass(frozen=True, slots=True)
class StateSequence:
    """One request's rows of a forward, for its recurrent layers."""

    first_row: int  # its first row in the forward (its rows are contiguous, in order)
    num_rows: int
    start: int  # the position of its first row; 0: the state starts fresh (all zeros)
    slot: int  # its live slot: written after the last row
    # (rows, slot): after that many of its rows (1..num_rows), the state is also copied to `slot`.
    snapshots: tuple[tuple[int, int], ...] = ()
    # The slot its state is read from before the first row (when start > 0); None: `slot` itself. The engine
    # reads one slot and writes another, so a step run again (a batch that failed, retried request by
    # request) reads the same state again; a prefix hit reads its snapshot.
    source: int | None = None

    @property
    def read_slot(self) -> int:
        return self.slot if self.source is None else self.source


class StateContext(ABC):
    """What a forward's recurrent layers see. `layer` is the recurrent layer's index among the model's
    recurrent layers (ModelConfig.recurrent_layers), not its model layer index."""

    sequences: Sequence[StateSequence]

    def __init__(self) -> None:
        self._shared: dict[str, Any] = {}

    def shared(self, key: str, build: Callable[[], Any]) -> Any:
        """What every recurrent layer of this forward would build the same (a kernel's per-step index
        tensors): built by the first layer that asks, then reused."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    @abstractmethod
    def read(self, layer: int, sequence: StateSequence) -> LayerState | None:
        """The state `sequence` starts from (None: fresh). The tensors are the cache's own: never changed in place."""

    @abstractmethod
    def write(self, layer: int, slot: int, state: LayerState) -> None:
        """Store `state` in `slot` (the live slot, or a snapshot's)."""

    def slot_tensors(self, layer: int) -> list[torch.Tensor] | None:
        """The layer's state tensors over every slot (`[num_slots, *shape]` each), for a kernel that reads
        and writes the slots itself (the sequences' `read_slot`, `slot` and snapshots); None where states
        are not kept in slots (a contiguous context)."""
        return None


class ContiguousStateContext(StateContext):
    """The forward's rows are one whole sequence from position 0 and nothing is kept (tests, perplexity):
    the state context of a forward without a KV cache."""

    def __init__(self, num_rows: int) -> None:
        super().__init__()
        self.sequences = (StateSequence(0, num_rows, 0, -1),)

    def read(self, layer: int, sequence: StateSequence) -> LayerState | None:
        return None

    def write(self, layer: int, slot: int, state: LayerState) -> None:
        pass


# (a segment's rows of one sequence, the state before them or None) -> (their outputs, the state after them)
Recurrence = Callable[[torch.Tensor, LayerState | None], tuple[torch.Tensor, LayerState]]


def scan_sequences(states: StateContext, layer: int, inputs: torch.Tensor, recurrence: Recurrence) -> torch.Tensor:
    """Run `recurrence` over each sequence's rows of `inputs` `[N, ...]` from its state, split where it asks
    for snapshots (each written out), its final state written to its live slot; the outputs of every row, in
    order. A family's recurrent layer projects all rows at once, then calls this for the part that carries
    state (the causal conv and the recurrence), then projects the outputs."""
    outputs = []
    for sequence in states.sequences:
        rows = inputs[sequence.first_row : sequence.first_row + sequence.num_rows]
        state = states.read(layer, sequence)
        done = 0
        for end, slot in sequence.snapshots:
            if end > done:
                piece, state = recurrence(rows[done:end], state)
                outputs.append(piece)
                done = end
            states.write(layer, slot, state)
        if done < sequence.num_rows:
            piece, state = recurrence(rows[done:], state)
            outputs.append(piece)
        states.write(layer, sequence.slot, state)
    return torch.cat(outputs) if len(outputs) != 1 else outputs[0]
