"""The engine's setting for bench/kv_compression.py: a prefix compressed in canonical chunks, as kvserve's engine does.

Chunk k is prefix tokens [k * chunk, (k + 1) * chunk); it is compressed when the prompt goes on at least `window`
tokens past it (kvserve.kv.compressed_chunks.ChunkPolicy, whose count this uses), each from its own K/V alone, to
`spec.chunk_budget(block_size)` tokens per layer and KV head (whole blocks), chunk 0 keeping the attention sinks;
the rest of the prefix stays exact. A ChunkMethod says how a chunk's tokens are scored and which are protected:
the engine's key-only scorers, a chunk-local Expected Attention / observed attention over the chunk's own last
queries, a protected recent tail per chunk, and AdaKV-style budgets shared by a layer's heads.

Heads that keep different counts (adaptive) are padded to one tensor with rows at an unreachable position, which
attend_kept's causal mask drops: the attention is exactly over the kept rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.compression import CompressedKV, PromptCapture, PromptKV
from kvserve.kv.compression.scoring import SCORERS, expected_attention
from kvserve.kv.compression.select import keep_top, protected_mask
from kvserve.kv.compression.spec import CompressionSpec

UNREACHABLE = 1 << 40  # a padded row's position: after every query, so the causal mask never attends to it


def observed_attention(kv: PromptKV) -> torch.Tensor:
    """The attention the chunk's own last queries gave each of its tokens (causal, softmax over the chunk), mean
    over the queries and the query heads of each KV head (SnapKV's vote, chunk-local)."""
    keys, queries = kv.keys.float(), kv.queries.float()
    kv_heads, length, dim = keys.shape
    heads, window = queries.shape[:2]
    scale = kv.scale if kv.scale is not None else dim ** -0.5
    grouped = keys.repeat_interleave(heads // kv_heads, dim=0)
    logits = scale * queries @ grouped.transpose(1, 2)  # [H, W, T]
    q_pos = torch.arange(length - window, length)
    logits = logits.masked_fill(torch.arange(length)[None, :] > q_pos[:, None], float("-inf"))
    return logits.softmax(-1).mean(1).view(kv_heads, heads // kv_heads, length).mean(1)


def attention_times_value(kv: PromptKV) -> torch.Tensor:
    return observed_attention(kv) * kv.values.float().norm(dim=-1)


@dataclass(frozen=True)
class ChunkMethod:
    """How one chunk is scored: `score` over the chunk's PromptKV (its last `queries` queries attached when > 0);
    `recent` chunk-end tokens always kept (an int, or a float: that fraction of the budget); `adaptive`: the
    layer's budget (heads x budget) shared by score mass, each head keeping at least `floor` of its even share."""

    name: str
    score: Callable[[PromptKV], torch.Tensor]
    queries: int = 0
    recent: int | float = 0
    adaptive: bool = False
    floor: float = 0.25
    chunk: int | None = None  # None: the spec's chunk


def recent_count(method: ChunkMethod, budget: int) -> int:
    return int(method.recent * budget) if isinstance(method.recent, float) else method.recent


def adaptive_keep(scores: torch.Tensor, budget: int, protected: torch.Tensor, floor: float) -> list[torch.Tensor]:
    """AdaKV: scores `[KVH, T]` (>= 0) normalised per head, the layer's heads x budget best over all heads, each
    head at least floor x budget (its protected tokens first). Ascending indices per head, lengths vary."""
    heads, length = scores.shape
    share = scores.float() / scores.float().sum(-1, keepdim=True).clamp_min(1e-30)
    ranked = share.masked_fill(protected, float("inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    minimum = max(int(floor * budget), int(protected.sum()))
    taken = torch.zeros(heads, length, dtype=torch.bool)
    taken.scatter_(1, order[:, :minimum], True)
    rest = ranked.masked_fill(taken, float("-inf")).flatten()
    extra = torch.sort(rest, descending=True, stable=True).indices[: heads * (budget - minimum)]
    taken.view(-1)[extra] = True
    return [torch.nonzero(taken[h]).flatten() for h in range(heads)]


def chunk_keep(kv: PromptKV, method: ChunkMethod, budget: int, sinks: int) -> list[torch.Tensor]:
    """One chunk of one layer -> kept indices per KV head (ascending)."""
    heads, length = kv.keys.shape[:2]
    if budget >= length:
        return [torch.arange(length)] * heads
    recent = min(recent_count(method, budget), budget - min(sinks, budget))
    scores = method.score(kv)
    if method.adaptive:
        return adaptive_keep(scores, budget, protected_mask(length, budget, sinks, recent), method.floor)
    return list(keep_top(scores, budget, sinks, recent))


def padded(rows: list[list[torch.Tensor]], kv: PromptKV) -> CompressedKV:
    """Per head, the kept prefix indices (concatenated over chunks) -> one CompressedKV, short heads padded."""
    heads, _, dim = kv.keys.shape
    per_head = [torch.cat(parts) for parts in rows]
    width = max(len(p) for p in per_head)
    keys = kv.keys.new_zeros(heads, width, dim)
    values = kv.values.new_zeros(heads, width, kv.values.shape[-1])
    positions = torch.full((heads, width), UNREACHABLE, dtype=kv.positions.dtype)
    for h, index in enumerate(per_head):
        keys[h, : len(index)], values[h, : len(index)] = kv.keys[h, index], kv.values[h, index]
        positions[h, : len(index)] = kv.positions[index]
    return CompressedKV(keys, values, positions, torch.zeros(heads, width, dtype=torch.long))


def chunked_layer(kv: PromptKV, queries: torch.Tensor, spec: CompressionSpec, method: ChunkMethod,
                  num_chunks: int, block_size: int) -> CompressedKV:
    """One layer's prefix (`kv`, every prefix query `queries` `[H, T, D]`) compressed chunk by chunk."""
    chunk = method.chunk or spec.chunk
    budget = CompressionSpec(spec.method, spec.ratio, spec.sinks, spec.window, chunk).chunk_budget(block_size)
    heads, length = kv.keys.shape[:2]
    rows: list[list[torch.Tensor]] = [[] for _ in range(heads)]
    for index in range(num_chunks):
        part = slice(index * chunk, (index + 1) * chunk)
        q = queries[:, part][:, chunk - method.queries :] if method.queries else None
        piece = PromptKV(kv.keys[:, part], kv.values[:, part], kv.positions[part], q, kv.scale)
        kept = chunk_keep(piece, method, budget, spec.sinks if index == 0 else 0)
        for h in range(heads):
            rows[h].append(kept[h] + index * chunk)
    tail = torch.arange(num_chunks * chunk, length)
    for h in range(heads):
        rows[h].append(tail)
    return padded(rows, kv)


def compressed_chunks(capture: PromptCapture, spec: CompressionSpec, method: ChunkMethod, layer_windows,
                      total_prompt: int, block_size: int = 16) -> list[CompressedKV]:
    """Every layer's prefix as the engine would hold it once the prompt (`total_prompt` tokens, the prefix first)
    is computed; sliding-window layers kept whole (the engine refuses them; their cache holds only the window)."""
    chunk = method.chunk or spec.chunk
    prefix_len = capture.layers()[0].keys.shape[1]
    policy = ChunkPolicy(chunk, chunk, spec.window, total_prompt)
    num_chunks = min(policy.num_chunks, prefix_len // chunk)
    out = []
    for kv, window in zip(capture.layers(), layer_windows):
        if window is not None:
            out.append(padded([[torch.arange(prefix_len)] for _ in range(kv.keys.shape[0])], kv))
        else:
            out.append(chunked_layer(kv, kv.queries, spec, method, num_chunks, block_size))
    return out


def key_only(name: str) -> Callable[[PromptKV], torch.Tensor]:
    return SCORERS[name]


def knorm_value(kv: PromptKV) -> torch.Tensor:
    """Low key norm (attention drawn) times value norm (what a token adds), both from the cache: key-only family."""
    return torch.exp(-kv.keys.float().norm(dim=-1) / kv.keys.shape[-1] ** 0.5) * kv.values.float().norm(dim=-1)


METHODS: dict[str, ChunkMethod] = {m.name: m for m in [
    ChunkMethod("streaming", key_only("streaming")),
    ChunkMethod("knorm", key_only("knorm")),
    ChunkMethod("keydiff", key_only("keydiff")),
    ChunkMethod("knorm+r64", key_only("knorm"), recent=64),
    ChunkMethod("knorm+third", key_only("knorm"), recent=1 / 3),
    ChunkMethod("keydiff+third", key_only("keydiff"), recent=1 / 3),
    ChunkMethod("knormv", knorm_value),
    ChunkMethod("ea_local", expected_attention, queries=64),
    ChunkMethod("ea_local+third", expected_attention, queries=64, recent=1 / 3),
    ChunkMethod("ea_local_ada", expected_attention, queries=64, adaptive=True),
    ChunkMethod("snap_local", attention_times_value, queries=64),
    ChunkMethod("snap_local+third", attention_times_value, queries=64, recent=1 / 3),
    ChunkMethod("snap_local_ada", attention_times_value, queries=64, adaptive=True),
    ChunkMethod("knorm@1024", key_only("knorm"), chunk=1024),
    ChunkMethod("knorm@2048", key_only("knorm"), chunk=2048),
    ChunkMethod("snap_local@1024", attention_times_value, queries=64, chunk=1024),
    ChunkMethod("snap_local@2048", attention_times_value, queries=64, chunk=2048),
    ChunkMethod("ea_local@2048", expected_attention, queries=64, chunk=2048),
]}


class FullCapture(PromptCapture):
    """PromptCapture keeping every query of the prompt (chunk-local methods read each chunk's last ones)."""

    def __init__(self, positions: torch.Tensor, layer_windows) -> None:
        super().__init__(positions, layer_windows, num_queries=len(positions))
