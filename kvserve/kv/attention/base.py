"""The attention seam: what a backend owns and what the model sees.

The model's attention layers see only an `AttentionContext` (one per
forward): `attend(layer, q, k, v, scale)`. Everything about where K/V live
and how a step's mixed batch is attended over belongs to the
`AttentionBackend` that built the context: the KV cache layout it wants, the
order of requests in the batch, the step's metadata and the kernels.

Layers differ only in their attention *kind*, i.e. their sliding window
(None = full attention). Layers of one kind share block tables in KV groups
(kv/groups/layout.py): a request brings one table per group, and a backend builds a
step's metadata once per group, never once per layer. A windowed group's
table holds the null block (id -1) where blocks behind the window were freed;
attention never reads those.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch

from kvserve.kernels.ops import RowTables
from kvserve.kv.cache.kv_spec import KVSpec
from kvserve.kv.cache.storage import PagedKVCache


def single_token_decode(num_new_tokens: int) -> bool:
    """The default decode rule (`AttentionBackend.is_decode`): one query token per request."""
    return num_new_tokens == 1


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One request's part of a step: its block table in each KV group, tokens already cached, tokens
    computed now, and per group the tokens before them its table no longer holds (KV compression: the
    group's slots start at num_computed_tokens - slot_offsets[group]; empty: none)."""

    block_tables: Sequence[Sequence[int]]
    num_computed_tokens: int
    num_new_tokens: int
    slot_offsets: Sequence[int] = ()


# A K = V layer's keys from its values (Gemma 4's global layers: one projection, V its norm, K that times the key
# norm's weight, rotated): values `[T, KVH, D]` at positions `[T]` -> keys `[T, KVH, D]`. The cache keeps V alone
# and derives the keys of every token it attends over, new ones too, so a cached key is the same bits as a new one.
KeysFromValues = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class PlainPagedStep:
    """A step whose every layer stores its new K/V in its own float cache and attends each row over its blocks
    with the C++ paged decode (`ops.paged_decode`): what a decoder's layers need to run as one kernel call
    (`ops.decoder_stack_forward_`). Layer i's caches are k_caches[i], v_caches[i]."""

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    slots: torch.Tensor  # [T * KVH] the flat cache rows of the new tokens' K/V
    rows: RowTables
    split_blocks: int


class AttentionContext(ABC):
    """What the model's attention layers see for one forward.

    Built by a backend for one step; valid for that forward only.
    """

    def plain_paged_step(self) -> PlainPagedStep | None:
        """This step's caches and tables where every layer attends as `PlainPagedStep` says, else None (the
        layers call `attend`). A layer attending through them must store and attend exactly as `attend` would."""
        return None

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
               sinks: torch.Tensor | None = None, keys_from_values: KeysFromValues | None = None) -> torch.Tensor:
        """The forward's N new tokens of `layer`: q `[N, H, D]`, k/v `[N, KVH, D]` (RoPE applied) -> `[N, H * D]`.
        `sinks` `[H]` (gpt-oss): each head's learned logit in its softmax denominator (kv/attention/reference.py);
        a context that cannot take them raises rather than attend without them.

        A K = V layer (ModelConfig.layer_k_eq_v) passes k=None, its values and `keys_from_values`; a layer
        that reads another's cache (ModelConfig.kv_source_layers) passes k=v=None and attends over its
        source's K/V, which the source stored earlier in the same forward.

        Stores the new K/V wherever the backend keeps them (if anywhere), then
        attends each token over its own sequence's keys up to and including its
        position, within `layer`'s sliding window. Rows come back in the order
        of the batch. GQA: H is a multiple of KVH; K/V are never repeated.
        """


class AttentionBackend(ABC):
    """One way of storing K/V and attending over them (the `cpu` kernels; later `cuda`).

    Contract, per step: the runner orders the scheduled requests with
    `batch_order`, lays their new tokens out in that order, builds the
    context with `build_context` from the requests' slices (same order), and
    hands the context to the model's forward. The cache it attends over was
    allocated by `allocate_kv_cache`; its spec's group layout says which
    group (and window) each layer has.
    """

    name: ClassVar[str]

    def is_decode(self, num_new_tokens: int) -> bool:
        """Whether a request's part of a step with `num_new_tokens` query tokens runs as a decode (batched
        with the other decodes, its queries attending in place) rather than as a prefill chunk. The one
        rule `batch_order` and the step metadata follow: a multi-token decode (k + 1 tokens per request,
        speculative decoding) changes it here."""
        return single_token_decode(num_new_tokens)

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, block_size: int, row_width: int) -> tuple[int, ...]:
        """Shape of one layer's K (or V, or quantization-parameter) tensor in the pool.

        `row_width` is the stored width of one (token, KV head) row: elements
        (packed for int4) or parameters. Dimension 0 must be the block and the
        last one the row width (storage writes flat rows and reads whole blocks).
        """

    # Whether this backend may run kvserve's C++ kernels (kernels/ops.py), in its pool's writes too.
    use_cpp_kernels: bool = False

    def allocate_kv_cache(self, spec: KVSpec, num_blocks: int, block_size: int,
                          device: str | torch.device = "cpu", max_num_seqs: int | None = None) -> PagedKVCache:
        """The paged pool on `device`, laid out as this backend wants it; with a blockwise codec, room for the
        open blocks of `max_num_seqs` requests (KVSpec.open_blocks_bytes)."""
        return PagedKVCache(spec, num_blocks, block_size, self.kv_cache_shape, device=device,
                            use_cpp_kernels=self.use_cpp_kernels, max_num_seqs=max_num_seqs)

    @abstractmethod
    def token_slots(self, cache: PagedKVCache, block_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The flat rows (as `PagedKVCache.write` and `read_rows` take them) of the tokens at (block, row)."""

    def batch_order(self, num_new_tokens: Sequence[int]) -> list[int]:
        """A permutation of the scheduled requests (given by their new-token counts): the batch order.

        The default keeps the scheduler's order. Correctness never depends on
        it; a backend that batches some requests together (decodes, by
        `is_decode`) asks for them to be adjacent.
        """
        return list(range(len(num_new_tokens)))

    @abstractmethod
    def build_context(self, cache: PagedKVCache, slices: Sequence[SequenceSlice]) -> AttentionContext:
        """The step's context: `slices` in batch order, each with one block table per group of
        `cache.spec.layout`.

        Block tables must cover every token computed this step, and hold real
        blocks wherever a query of the step may read.
        """
