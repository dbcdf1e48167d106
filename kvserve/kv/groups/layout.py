"""KV groups: layers that share block tables (DESIGN §3, sliding windows).

Layers differ in their attention kind: full attention, or a sliding window of
W tokens. A windowed layer never reads a key more than W - 1 positions back,
so the blocks behind its window can be freed as a request advances, while a
full-attention layer keeps every block. Layers of one kind can share a block
table; layers of different kinds cannot.

All blocks of the pool have one size, so one free queue serves every group
(vLLM's hybrid allocator does the same): a *page* holds `page_layers` layers'
K/V for `block_size` tokens, and each kind's layers are cut into groups of
exactly `page_layers` layers, `page_layers` being the greatest common divisor
of the kinds' layer counts. Gemma 3 270M (15 windowed layers, 3 full) has six
groups of 3 layers: five windowed, one full. A model of one kind has one group
holding every layer, which is the plain paged cache.

Layer i of the model lives in group `layer_group[i]`, in slot `layer_slot[i]`
of that group's pages; storage keeps one tensor per slot, addressed by the
page ids of the layer's group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from kvserve.arith import cdiv


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int | None  # the sliding window of its layers (None: full attention)
    layers: tuple[int, ...]  # model layer indices, in slot order


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    groups: tuple[KVGroup, ...]
    page_layers: int  # layers per page, the same for every group
    layer_group: tuple[int, ...]  # layer -> its group
    layer_slot: tuple[int, ...]  # layer -> its slot (storage tensor) within the group's pages

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def has_windows(self) -> bool:
        return any(window is not None for window in self.windows)

    def describe(self) -> str:
        """e.g. '6 groups of 3 layers: 5 windowed (512 tokens), 1 full attention'."""
        kinds: dict[int | None, int] = {}
        for group in self.groups:
            kinds[group.window] = kinds.get(group.window, 0) + 1
        parts = [f"{count} {'full attention' if window is None else f'windowed ({window} tokens)'}"
                 for window, count in kinds.items()]
        plural = "s" if self.num_groups > 1 else ""
        return f"{self.num_groups} group{plural} of {self.page_layers} layers: {', '.join(parts)}"


@lru_cache(maxsize=64)
def kv_group_layout(layer_windows: tuple[int | None, ...]) -> KVGroupLayout:
    """Cut the layers (given by their windows, None = full) into equal-sized groups of one kind each."""
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_kind.setdefault(window, []).append(layer)
    page_layers = math.gcd(*(len(layers) for layers in by_kind.values()))
    groups = tuple(KVGroup(window, tuple(layers[start : start + page_layers]))
                   for window, layers in by_kind.items() for start in range(0, len(layers), page_layers))
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for index, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            layer_group[layer], layer_slot[layer] = index, slot
    return KVGroupLayout(groups, page_layers, tuple(layer_group), tuple(layer_slot))


def first_needed_block(window: int | None, position: int, block_size: int) -> int:
    """The first block a query at `position` reads in a layer with `window` (0 for full attention)."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def blocks_held(window: int | None, num_tokens: int, block_size: int) -> int:
    """Blocks a group holds for a request with `num_tokens` computed, between steps: every block for full
    attention; for a window, those from the first the next query (at position `num_tokens`) reads."""
    total = cdiv(num_tokens, block_size)
    return total - min(first_needed_block(window, num_tokens, block_size), total)


def max_blocks_held(window: int | None, block_size: int) -> int | None:
    """The most blocks a windowed group holds per request between steps (None: unbounded, full attention)."""
    return None if window is None else cdiv(window - 1, block_size) + 1
