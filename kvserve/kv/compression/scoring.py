"""Question-agnostic token scores: one layer's prompt K/V -> how much each token is worth keeping, per KV head.

Higher is kept. Every scorer reads only the prompt (never a question that follows), so the kept tokens
are a function of the prefix alone and a compressed prefix can be shared. Keys are as the cache holds them
(RoPE applied at their positions). Definitions follow NVIDIA kvpress's presses; the code is ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PromptKV:
    """One layer's prompt K/V: keys/values `[KVH, T, D]`, positions `[T]`.

    `queries` `[H, W, D]` (RoPE applied), the queries of the prompt's last W tokens, which the prefill computes
    anyway (its last chunk holds them): only Expected Attention reads them, and refuses to run without them.
    `scale`: the layer's attention scale (the model's, e.g. Gemma's query_pre_attn_scalar).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor | None = None
    scale: float | None = None


Scorer = Callable[[PromptKV], torch.Tensor]  # -> scores `[KVH, T]`, float32


def streaming(kv: PromptKV) -> torch.Tensor:
    """StreamingLLM: the most recent tokens (the sinks are kept by the selection, for every method)."""
    heads, length = kv.keys.shape[:2]
    return kv.positions.to(torch.float32).expand(heads, length).clone()


def knorm(kv: PromptKV) -> torch.Tensor:
    """Knorm (Devoto et al. 2024): keys with a low L2 norm draw the most attention; keep the lowest norms."""
    return -kv.keys.float().norm(dim=-1)


def keydiff(kv: PromptKV) -> torch.Tensor:
    """KeyDiff (Park et al. 2025): keep the keys least similar to the head's mean key direction (the distinctive
    ones); a key like the average one adds little that the others do not."""
    keys = kv.keys.float()
    anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)  # [KVH, 1, D]
    return -F.cosine_similarity(keys, anchor, dim=-1)


def expected_attention(kv: PromptKV) -> torch.Tensor:
    """Expected Attention (Devoto et al. 2025): the attention a future query would give each token, the query
    drawn from a Gaussian fitted to the recent queries, times the token's value norm (what it would add).

    For q ~ N(mu, S), E[exp(s q.k)] = exp(s mu.k + s^2 k'Sk / 2); softmax over the tokens per query head, mean
    over the heads that share a KV head. kvpress fits the Gaussian to every prompt query before RoPE and rotates it
    by the mean rotation of the next 512 positions; we fit it to the last W queries as rotated (what the prefill
    has at hand, model-independent): their rotation spread plays the part of kvpress's averaging over positions.
    """
    if kv.queries is None or kv.queries.shape[1] < 2:
        raise ValueError("expected_attention needs the prompt's last queries (PromptKV.queries, at least 2)")
    keys, queries = kv.keys.float(), kv.queries.float()
    kv_heads, length, dim = keys.shape
    heads = queries.shape[0]
    scale = kv.scale if kv.scale is not None else dim ** -0.5
    mean = queries.mean(dim=1)  # [H, D]
    centred = queries - mean[:, None]
    cov = centred.transpose(1, 2) @ centred / queries.shape[1]  # [H, D, D]
    grouped = keys.repeat_interleave(heads // kv_heads, dim=0)  # [H, T, D]
    logits = scale * torch.einsum("hd,htd->ht", mean, grouped)
    logits += 0.5 * scale**2 * ((grouped @ cov) * grouped).sum(-1)
    probs = logits.softmax(dim=-1).view(kv_heads, heads // kv_heads, length).mean(dim=1)
    return probs * kv.values.float().norm(dim=-1)


SCORERS: dict[str, Scorer] = {
    "streaming": streaming, "knorm": knorm, "keydiff": keydiff, "expected_attention": expected_attention,
}
