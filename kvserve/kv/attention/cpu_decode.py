"""The `cpu` backend's decode kernels: one query token per request, over its cached blocks.

Split-KV ("flash-decoding") over only the valid blocks of every request at
once: scores per (request, block), a per-block max and sum, then a max/sum
merge per request. No padding to the longest request, no per-request Python
loop; DESIGN §3 records it ~1.5x faster than a per-sequence SDPA loop on this
CPU. When the decoding requests share many blocks (a common prefix, or a
single request), one SDPA runs over the union of their blocks, each read
once, with a per-request mask: split-KV would gather a shared prefix once per
request (W3 with caching: 17.9 s -> 12.0 s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels import ops
from kvserve.kv.attention.cpu_metadata import DecodeMetadata
from kvserve.kv.cache.quant import KVCodec, int4_group
from kvserve.kv.attention.reference import with_sinks
from kvserve.kv.cache.storage import GatheredKV, PagedKVCache


def _kernel_kind(codec: KVCodec) -> int | None:
    """The C++ kernel's name for a quantized codec it widens (fp8: none, the torch path)."""
    if codec.kind == "scale" and codec.storage_dtype == torch.int8:
        return ops.INT8_ROW
    if codec.kind == "affine4":
        return ops.INT4_ROW
    if codec.kind == "channel" and codec.bits == 4:
        return ops.INT4_CHANNEL
    return None


def cpp_decode_reads(cache: PagedKVCache) -> bool:
    """Whether the C++ decode kernel reads this pool in place: float K and V of one dtype, or int8 / int4
    on both sides (any pair of them)."""
    k, v = cache.spec.k_codec, cache.spec.v_codec
    if k.kind == "float" and v.kind == "float":
        return cache.k[0].dtype == cache.v[0].dtype and cache.k[0].dtype in ops.CACHE_DTYPES
    return _kernel_kind(k) is not None and _kernel_kind(v) is not None


def cpp_decode(cache: PagedKVCache, layer: int, q: torch.Tensor, meta: DecodeMetadata, scale: float,
               split_blocks: int, sinks: torch.Tensor | None = None,
               own_blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The C++ kernel's decode of `layer` over the pool where it lies (`cpp_decode_reads` said it can); `sinks`
    `[H]` join each row's softmax denominator in the kernel's merge of its splits; `own_blocks`: rows that read
    the block holding their position beside the pool (open blocks only: cpu_own_blocks.py)."""
    rows = meta.row_tables()
    if not cache.k_params and not cache.v_params:
        return ops.paged_decode(q, cache.k[layer], cache.v[layer], rows, scale, split_blocks, sinks)
    spec, open_ = cache.spec, cache.open_blocks
    tensor = spec.layout.layer_slot[layer]
    open_tensors = (open_.k[tensor], open_.v[tensor], open_.slot_of[tensor]) if open_ is not None else None
    return ops.paged_decode_quant(q, (cache.k[layer], cache.k_params[layer], _kernel_kind(spec.k_codec)),
                                  (cache.v[layer], cache.v_params[layer], _kernel_kind(spec.v_codec)),
                                  int4_group(spec.head_dim), open_tensors, rows, scale, split_blocks, sinks,
                                  own_blocks)


def split_kv_decode(q: torch.Tensor, kv: GatheredKV, meta: DecodeMetadata, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[B, H, D]` (one token per request) -> `[B, H * D]`, over the gathered valid blocks `kv`.

    Per-row K/V scales of a quantized cache are folded in: into the scores for
    K, into the probabilities for V (after the softmax sums, which they do not
    change).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    group = num_heads // num_kv_heads
    queries = q.view(num_seqs, num_kv_heads, group, head_dim).index_select(0, meta.seq_index)  # [NB, KVH, G, D]
    scores = torch.matmul(queries, kv.k.transpose(-1, -2)).mul_(scale)  # [NB, KVH, G, bs]
    if kv.k_scale is not None:
        scores.mul_(kv.k_scale[:, :, None, :])
    scores.masked_fill_(~meta.key_valid[:, None, None, :], float("-inf"))
    block_max = scores.amax(dim=-1, keepdim=True)  # finite: every listed block has a valid key
    probs = torch.exp(scores - block_max)
    block_sum = probs.sum(dim=-1, keepdim=True)
    if kv.v_scale is not None:
        probs.mul_(kv.v_scale[:, :, None, :])
    block_out = torch.matmul(probs, kv.v)  # [NB, KVH, G, D]
    # Merge the blocks of each request: rescale to the request's global max.
    seq_max = torch.full((num_seqs, num_kv_heads, group, 1), float("-inf"), device=q.device)
    index = meta.seq_index.view(-1, 1, 1, 1).expand_as(block_max)
    seq_max.scatter_reduce_(0, index, block_max, reduce="amax")
    weight = torch.exp(block_max - seq_max[meta.seq_index])
    out = torch.zeros(num_seqs, num_kv_heads, group, head_dim, device=q.device).index_add_(
        0, meta.seq_index, block_out * weight)
    norm = torch.zeros(num_seqs, num_kv_heads, group, 1, device=q.device).index_add_(0, meta.seq_index,
                                                                                     block_sum * weight)
    out = out / norm
    if sinks is not None:  # [B, KVH, G, D] with the heads first, as with_sinks takes them
        lse = (seq_max + norm.log()).squeeze(-1)
        out = with_sinks(out.flatten(1, 2).transpose(0, 1), lse.flatten(1, 2).transpose(0, 1), sinks).transpose(0, 1)
    return out.reshape(num_seqs, num_heads * head_dim)


def union_decode(q: torch.Tensor, kv: GatheredKV, meta: DecodeMetadata, scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[B, H, D]` -> `[B, H * D]`: attention over the union of the requests' blocks (`kv`), each read once.

    Float blocks go through SDPA. Blocks with per-row scales (int8/fp8) use the
    same math written out, with the scales folded into the scores and the
    probabilities rather than multiplied into every element of K and V; so do attention sinks (`sinks` `[H]`),
    for the rows' log-sum-exps.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    keys = kv.k.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    values = kv.v.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    if kv.k_scale is None and kv.v_scale is None and sinks is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=meta.union_mask,
            scale=scale, enable_gqa=num_heads != num_kv_heads,
        )  # [1, H, B, D]
        return out[0].transpose(0, 1).reshape(num_seqs, num_heads * head_dim)
    group = num_heads // num_kv_heads
    # Rows ordered (head in group, request): [KVH, G * B, D]
    queries = q.view(num_seqs, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)  # [KVH, G * B, U * bs]
    if kv.k_scale is not None:
        scores.mul_(kv.k_scale.transpose(0, 1).reshape(num_kv_heads, 1, -1))
    mask = meta.union_mask.repeat(group, 1)  # [G * B, U * bs], same row order
    scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [KVH, G * B]
    probs = (scores - lse[..., None]).exp_()
    if kv.v_scale is not None:
        probs.mul_(kv.v_scale.transpose(0, 1).reshape(num_kv_heads, 1, -1))
    out = torch.matmul(probs, values)  # [KVH, G * B, D]
    if sinks is not None:  # the rows of KV head h are its G query heads, each over the B requests
        out = with_sinks(out.view(num_heads, num_seqs, head_dim), lse.view(num_heads, num_seqs), sinks)
    return out.view(num_kv_heads, group, num_seqs, head_dim).permute(2, 0, 1, 3).reshape(num_seqs, -1)
