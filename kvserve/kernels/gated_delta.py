"""The gated delta rule (Gated DeltaNet's recurrence) for kvserve's recurrent layers: the C++ kernel
(csrc/gated_delta.cpp) where it is built and every tensor is on the CPU in float32, else the same math in
torch (gated_delta_torch.py). A token's bits depend on its own sequence's rows alone."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvserve.kernels.build import cpu_kernels as kernels  # the compiled kernels, or None
from kvserve.kernels.gated_delta_torch import gated_delta_slots
from kvserve.kernels.ops import _F32, _LONG, _cpu_fp32  # the checks every kernel call makes


class DeltaSequences(NamedTuple):
    """The sequences of one `gated_delta_rule_slots_` call (int64, CPU): sequence b's rows are
    row_starts[b] .. row_starts[b + 1]; its state starts from slot read_slots[b] (-1: zeros) and ends in
    write_slots[b]; snapshots `[S, 3]` (sequence, rows, slot), sorted: the state after that many of its rows
    is also written to slot. A slot may be read and written by one sequence (in place), never written by
    two, nor written by one and read by another."""

    row_starts: torch.Tensor
    read_slots: torch.Tensor
    write_slots: torch.Tensor
    snapshots: torch.Tensor

    @classmethod
    def of(cls, row_counts: list[int], read_slots: list[int], write_slots: list[int],
           snapshots: list[tuple[int, int, int]] = ()) -> DeltaSequences:
        starts = [0]
        for count in row_counts:
            starts.append(starts[-1] + count)
        # One tensor, four views of it: a decode step builds this once per layer.
        values = torch.tensor([*starts, *read_slots, *write_slots, *(n for row in sorted(snapshots) for n in row)],
                              dtype=_LONG)
        count = len(row_counts)
        return cls(values[: count + 1], values[count + 1 : 2 * count + 1], values[2 * count + 1 : 3 * count + 1],
                   values[3 * count + 1 :].view(-1, 3))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _cpu_long(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype is _LONG


MAX_KERNEL_KEY_DIM = 512  # the kernel's largest dk (gated_delta.cpp: its normalised q and k on the stack)


def _check_delta_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        states: torch.Tensor, read_states: torch.Tensor) -> None:
    rows, heads = v.shape[:2] if v.dim() == 3 else (-1, -1)
    if (v.dim() != 3 or q.dim() != 3 or q.shape != k.shape or k.shape[0] != rows or k.shape[1] == 0
            or heads % k.shape[1] or g.shape != (rows, heads) or beta.shape != (rows, heads)):
        raise ValueError(f"gated delta rule: q, k [N, Hk, dk], v [N, Hv, dv] (Hv a multiple of Hk), g, beta [N, Hv]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}")
    state_shape = (heads, k.shape[2], v.shape[2])
    for name, tensor in (("states", states), ("read_states", read_states)):
        if tensor.dim() != 4 or tensor.shape[1:] != state_shape:
            raise ValueError(f"gated delta rule: {name} must be [slots, {', '.join(map(str, state_shape))}], "
                             f"got {tuple(tensor.shape)}")


def gated_delta_isa() -> str | None:
    """The instruction set the gated delta kernel runs on here ("avx512", "avx2", "portable"), or None."""
    ext = kernels()
    return None if ext is None else ext.gated_delta_isa()


def gated_delta_rule_slots_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, sequences: DeltaSequences, read_states: torch.Tensor | None = None,
                            normalize_qk: bool = True, scale: float | None = None, isa: int = -1) -> torch.Tensor:
    """The gated delta rule (Gated DeltaNet; transformers' torch_recurrent_gated_delta_rule), token by token,
    for a batch of sequences whose states live in slots of `states` `[slots, Hv, dk, dv]` fp32 (the state
    cache's tensor, written in place; read from `read_states` where given): q, k `[N, Hk, dk]` (each key head
    serves Hv / Hk consecutive value heads), v `[N, Hv, dv]`, g (log decay), beta `[N, Hv]` -> outputs
    `[N, Hv, dv]` fp32. With `normalize_qk` q and k are l2-normalised here (eps 1e-6) as Qwen3.5 asks
    (use_qk_l2norm_in_kernel); q is then scaled by `scale` (None: dk ** -0.5), as transformers always does.
    A token's bits depend on its sequence's rows up to it alone: not on the batch, on where a segment
    starts (a state resumed from a slot is the state the whole run held), nor on the threads. `isa`: -1 the
    best this build has; 0 / 1 / 2 force portable / AVX2 / AVX-512 (tests). The C++ kernel where built and
    every tensor is on the CPU in float32, else the same math in torch (gated_delta_torch.py)."""
    read_states = states if read_states is None else read_states
    _check_delta_shapes(q, k, v, g, beta, states, read_states)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v), _last_contiguous(g), \
        _last_contiguous(beta)
    out = torch.empty(v.shape, dtype=_F32, device=v.device)
    ext = kernels()
    # Plain attribute reads, no generators: this runs once per recurrent layer per step.
    row_starts, read_slots, write_slots, snapshots = sequences
    if (ext is not None and k.shape[-1] <= MAX_KERNEL_KEY_DIM and _cpu_fp32(q) and _cpu_fp32(k) and _cpu_fp32(v)
            and _cpu_fp32(g) and _cpu_fp32(beta) and _cpu_fp32(states) and _cpu_fp32(read_states)
            and _cpu_long(row_starts) and _cpu_long(read_slots) and _cpu_long(write_slots) and _cpu_long(snapshots)):
        ext.gated_delta_rule_(q, k, v, g, beta, out, read_states, states, row_starts, read_slots, write_slots,
                              snapshots, normalize_qk, scale, isa)
        return out
    gated_delta_slots(q, k, v, g, beta, out, read_states, states, *(x.tolist() for x in sequences[:3]),
                      [tuple(row) for row in sequences.snapshots.tolist()], normalize_qk, scale)
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None = None, snapshot_rows: Sequence[int] = (), normalize_qk: bool = True,
                     scale: float | None = None, isa: int = -1
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`gated_delta_rule_slots_` for one sequence's rows (q, k `[T, Hk, dk]`, ...) from `state` `[Hv, dk, dv]`
    (None: zeros; not changed) -> (outputs `[T, Hv, dv]`, the state after the last row, the states after
    each of `snapshot_rows` rows (ascending, 0..T))."""
    heads, key_dim, value_dim = v.shape[1], k.shape[-1], v.shape[-1]
    rows = list(snapshot_rows)
    written = torch.empty(1 + len(rows), heads, key_dim, value_dim, dtype=_F32, device=v.device)
    if state is None:
        read, read_slot = written, -1
    else:
        read, read_slot = state.to(_F32).contiguous().reshape(1, heads, key_dim, value_dim), 0
    sequences = _one_sequence(v.shape[0], read_slot, tuple(rows))
    out = gated_delta_rule_slots_(q, k, v, g, beta, written, sequences, read, normalize_qk, scale, isa)
    return out, written[0], list(written[1:].unbind(0))


@functools.lru_cache(maxsize=256)
def _one_sequence(rows: int, read_slot: int, snapshot_rows: tuple[int, ...]) -> DeltaSequences:
    """`gated_delta_rule`'s one sequence: its final state to slot 0, snapshots to 1.. (kept: the kernel only
    reads them, and building them cost more than a decode's kernel call)."""
    return DeltaSequences.of([rows], [read_slot], [0], [(0, done, 1 + i) for i, done in enumerate(snapshot_rows)])
