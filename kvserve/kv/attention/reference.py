"""Reference attention for one sequence: SDPA with an explicit bottom-right-aligned causal mask.

The prefill path of the `cpu` backend and the contiguous (no-cache) context
use it; tests compare every other path against it.

Attention sinks (gpt-oss): each head has a learned logit that joins the softmax denominator and attends to
nothing, so a head may give a query's keys less than all its weight. A path that has each row's log-sum-exp
L of the scores applies it after the fact: out * e^L / (e^L + e^sink) = out * sigmoid(L - sink)
(`with_sinks`); every attention path of the cpu backend does (the C++ kernel in its split merge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_applies(last_position: int, sliding_window: int | None, key_start: int = 0) -> bool:
    """Whether a query at `last_position` sees fewer keys than those from `key_start` on (its window cuts them)."""
    return sliding_window is not None and last_position - key_start >= sliding_window


def attention_mask(q_positions: torch.Tensor, num_keys: int, sliding_window: int | None,
                   key_start: int = 0) -> torch.Tensor | None:
    """Boolean `[T, num_keys]` mask (True = attend) for keys at positions key_start..key_start+num_keys-1.

    Causality is by absolute position, i.e. bottom-right aligned when the
    queries are the last T of the keys; `is_causal=True` in SDPA is top-left
    aligned and would be wrong whenever queries < keys. Returns None when every
    query may see every key (a plain decode step), so SDPA takes its fast path.
    """
    last = int(q_positions[-1])
    windowed = window_applies(last, sliding_window, key_start)
    if q_positions.numel() == 1 and last == key_start + num_keys - 1 and not windowed:
        return None
    k_positions = torch.arange(key_start, key_start + num_keys, device=q_positions.device)
    mask = k_positions[None, :] <= q_positions[:, None]
    if windowed:
        mask &= (q_positions[:, None] - k_positions[None, :]) < sliding_window
    return mask


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention output `out` `[H, ..., D]` whose rows' score log-sum-exps are `lse` `[H, ...]`, with each head's
    sink logit (`sinks` `[H]`) added to its softmax denominator; `out` itself when there are none."""
    if sinks is None:
        return out
    sink = sinks.to(lse.dtype).view(-1, *([1] * (lse.dim() - 1)))
    return out * torch.sigmoid(lse - sink).unsqueeze(-1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q `[H, T, D]` over k/v `[KVH, L, D]` (GQA) where `mask` `[T, L]` allows (None: every
    key): the output `[H, T, D]` and each row's log-sum-exp `[H, T]` (every row must allow a key)."""
    heads, num_queries, head_dim = q.shape
    kv_heads = k.shape[0]
    grouped = q.reshape(kv_heads, heads // kv_heads * num_queries, head_dim)
    scores = torch.matmul(grouped, k.transpose(1, 2)).mul_(scale).view(kv_heads, -1, num_queries, k.shape[1])
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = (scores - lse[..., None]).exp_().view(kv_heads, -1, k.shape[1])
    out = torch.matmul(probs, v).view(heads, num_queries, head_dim)
    return out, lse.view(heads, num_queries)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    key_start: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: q `[num_heads, T, D]`, k/v `[num_kv_heads, L, D]` -> `[T, num_heads * D]`.

    Keys are positions key_start..key_start+L-1 (a windowed layer reads from its window's first block);
    GQA through SDPA's `enable_gqa` (no repeated K/V). With `sinks` `[num_heads]` the softmax is written out,
    for its log-sum-exps (`with_sinks`).
    """
    mask = attention_mask(q_positions, k.shape[1], sliding_window, key_start)
    if sinks is not None:
        out, lse = masked_attention(q, k, v, mask, scale)
        return with_sinks(out, lse, sinks).transpose(0, 1).reshape(q.shape[1], -1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)
