"""A prefill chunk's attention on the `cpu` backend: causal, without a mask over the whole chunk.

A chunk of T queries attends over its request's L keys: the L - T cached
before it, all visible, then its own T, causally (bottom-right aligned).
SDPA's `is_causal` is top-left aligned, so the reference path
(reference.py) passes an explicit [T, L] mask, and with a mask torch's CPU
flash attention computes every (query, key) pair and reads the mask too.
Here the two parts run apart, the cached keys unmasked and the chunk's own
square with `is_causal` (which skips the blocks above the diagonal), and
merge as two blocks of one softmax through the log-sum-exp the flash kernel
returns. Measured on the AMD EPYC (9 heads / 3 KV heads x 64, 2 threads),
one layer: a first 2,048-token chunk 75.7 -> 40.1 ms, a second one (2,048
cached keys) 160.6 -> 99.5 ms. Windowed layers, whose windows cut the
cached keys, keep the masked path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kv.attention.reference import attend, masked_attention, window_applies, with_sinks

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float,
                      sliding_window: int | None = None, key_start: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As `reference.attend`: q `[H, T, D]` at `q_positions`, k/v `[KVH, L, D]` at key_start..key_start+L-1,
    -> `[T, H * D]`; the queries are the last T of the keys (a prefill chunk). `sinks` `[H]`: reference.py."""
    num_queries, num_keys = q.shape[1], k.shape[1]
    cached = num_keys - num_queries
    last = int(q_positions[-1])
    chunk_is_last = cached >= 0 and last == key_start + num_keys - 1 and int(q_positions[0]) == last - num_queries + 1
    if (_flash is None or not chunk_is_last or window_applies(last, sliding_window, key_start)
            or q.dtype != torch.float32):
        return attend(q, k, v, q_positions, scale, sliding_window, key_start, sinks)
    queries = q.unsqueeze(0)
    own, own_lse = _flash(queries, k[None, :, cached:], v[None, :, cached:], 0.0, True, scale=scale)
    if cached:
        before, before_lse = _flash(queries, k[None, :, :cached], v[None, :, :cached], 0.0, False, scale=scale)
        # Two blocks of one softmax: weight each part by its share of the total exp-sum.
        top = torch.maximum(own_lse, before_lse)
        own_weight, before_weight = (own_lse - top).exp_(), (before_lse - top).exp_()
        total = own_weight + before_weight
        own = own * (own_weight / total)[..., None] + before * (before_weight / total)[..., None]
        own_lse = top + total.log() if sinks is not None else own_lse
    return with_sinks(own[0], own_lse[0], sinks).transpose(0, 1).reshape(num_queries, -1)


def open_block_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor,
                       q_positions: torch.Tensor, scale: float, block_size: int, sliding_window: int | None,
                       key_start: int, own_start: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk over a pool with open blocks (kv/cache/open_blocks.py): each query sees its own block, up to
    itself, in float16 (`own_k`/`own_v`: positions own_start.., the chunk's first block on) unless it is that
    block's last row, and every other key as the pool holds it (`k`/`v`: positions key_start.., read after
    the chunk was written, so the blocks it filled are encoded). That is what a decode at the same position
    reads (its block is open until its last row is written), so a prompt gives the same tokens however it
    is chunked. q `[H, T, D]`, k/v `[KVH, L, D]`, own_k/own_v `[KVH, O, D]` -> `[T, H * D]`.

    The keys before the chunk's first block are visible to every query: without a window they take the flash
    kernel unmasked, and only the chunk's own blocks (both readings) are scored here with a mask; the two
    parts merge through their log-sum-exps."""
    before = own_start - key_start
    flash = _flash is not None and sliding_window is None and q.dtype == torch.float32 and before > 0
    lo = before if flash else 0  # keys scored with the mask start here
    queries = q_positions[:, None]
    q_block = torch.div(queries, block_size, rounding_mode="floor")
    in_own = (queries % block_size) != block_size - 1  # the last row of a block sees it encoded, as a decode does
    main_pos = torch.arange(key_start + lo, key_start + k.shape[1], device=q.device)[None, :]
    own_pos = torch.arange(own_start, own_start + own_k.shape[1], device=q.device)[None, :]
    main = (main_pos <= queries) & ~((torch.div(main_pos, block_size, rounding_mode="floor") == q_block) & in_own)
    own = (own_pos <= queries) & (torch.div(own_pos, block_size, rounding_mode="floor") == q_block) & in_own
    if sliding_window is not None:
        main &= queries - main_pos < sliding_window
        own &= queries - own_pos < sliding_window
    keys = torch.cat([k[:, lo:], own_k.to(k.dtype)], dim=1)
    values = torch.cat([v[:, lo:], own_v.to(v.dtype)], dim=1)
    out, lse = masked_attention(q, keys, values, torch.cat([main, own], dim=1), scale)
    if flash:
        first, first_lse = _flash(q.unsqueeze(0), k[None, :, :lo], v[None, :, :lo], 0.0, False, scale=scale)
        top = torch.maximum(lse, first_lse[0])
        weight, first_weight = (lse - top).exp_(), (first_lse[0] - top).exp_()
        total = weight + first_weight
        out = out * (weight / total)[..., None] + first[0] * (first_weight / total)[..., None]
        lse = top + total.log()
    return with_sinks(out, lse, sinks).transpose(0, 1).reshape(q.shape[1], -1)

