"""The gated delta rule in torch, token by token: the path where kvserve's C++ kernel
(csrc/gated_delta.cpp) is not built or does not take the tensors (another device or dtype).

The same math as transformers' torch_recurrent_gated_delta_rule, one token at a time for every head at once.
Every op runs on one token's tensors, whose shapes do not depend on the segment or the batch (even the
exp of g and the norms of q and k: torch's vectorized loops finish a tensor's odd tail with scalar code,
so an op over a whole segment would give a token's bits by where it sits), so a sequence run whole, split
at any row and resumed from the state there, or beside others gives the same bits on this path too. The
per-head products are batched matrix products (bmm: no [Hv, dk, dv] temporary per product, ~10x faster
than broadcast-and-sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NORM_EPS = 1e-6  # transformers' l2norm (the FLA library's)
_F32 = torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + NORM_EPS)


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None, snapshot_rows: Sequence[int], normalize_qk: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's rows: q, k `[T, Hk, dk]`, v `[T, Hv, dv]`, g, beta `[T, Hv]` from `state` `[Hv, dk, dv]`
    (None: zeros; read, not changed) -> (outputs `[T, Hv, dv]`, the state after the last row, the states
    after each of `snapshot_rows` rows (ascending, 0..T)); all float32."""
    rows, key_heads, _ = k.shape
    value_heads, value_dim = v.shape[1:]
    group = value_heads // key_heads
    current = (torch.zeros(value_heads, k.shape[2], value_dim, dtype=_F32, device=v.device) if state is None
               else state.to(_F32, copy=True))
    out = torch.empty(rows, value_heads, value_dim, dtype=_F32, device=v.device)
    wanted = list(snapshot_rows)
    snapshots = [current.clone() for _ in wanted if _ == 0]
    for t in range(rows):
        q_t, k_t = q[t].to(_F32), k[t].to(_F32)
        if normalize_qk:
            q_t, k_t = _l2norm(q_t), _l2norm(k_t)
        q_t = q_t * scale
        if group > 1:  # each key head serves `group` consecutive value heads
            q_t, k_t = q_t.repeat_interleave(group, dim=0), k_t.repeat_interleave(group, dim=0)
        current = current * g[t].to(_F32).exp()[:, None, None]
        kv_mem = torch.bmm(k_t[:, None, :], current)[:, 0]  # S^T k per head
        delta = (v[t].to(_F32) - kv_mem) * beta[t].to(_F32)[:, None]
        current = torch.baddbmm(current, k_t[:, :, None], delta[:, None, :])  # S + k delta^T
        out[t] = torch.bmm(q_t[:, None, :], current)[:, 0]
        snapshots.extend(current.clone() for done in wanted if done == t + 1)
    return out, current, snapshots


def gated_delta_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      out: torch.Tensor, read_states: torch.Tensor, write_states: torch.Tensor,
                      row_starts: Sequence[int], read_slots: Sequence[int], write_slots: Sequence[int],
                      snapshots: Sequence[tuple[int, int, int]], normalize_qk: bool, scale: float) -> None:
    """The kernel's batched form (gated_delta.gated_delta_rule_slots_) sequence by sequence: every state is read
    before any is written, as the kernel's threads do (it refuses a slot read by one sequence and written
    by another)."""
    starts = [None if slot < 0 else read_states[slot].clone() for slot in read_slots]
    for b, (first, end) in enumerate(zip(row_starts[:-1], row_starts[1:])):
        mine = [(done, slot) for seq, done, slot in snapshots if seq == b]
        rows = slice(first, end)
        out[rows], final, states = gated_delta_scan(q[rows], k[rows], v[rows], g[rows], beta[rows], starts[b],
                                                    [done for done, _ in mine], normalize_qk, scale)
        for (_, slot), state in zip(mine, states):
            write_states[slot].copy_(state)
        write_states[write_slots[b]].copy_(final)
