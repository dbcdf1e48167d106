"""How many bytes one token of KV cache takes: the ONE formula (DESIGN §3).

The loader's summary, the cache allocator and the memory planner all go
through `kv_spec`; nothing else in kvserve may recompute it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.errors import InvalidRequestError
from kvserve.kv.groups.layout import KVGroupLayout, blocks_held, kv_group_layout
from kvserve.kv.cache.packing import LayerKV, is_plain, place_layers, row_geometry, rows_used, side_rows, slots_needed
from kvserve.kv.cache.quant import CODECS, OPEN_BLOCK_DTYPE, PARAM_DTYPE, REFERENCE_BLOCK, KVCodec, key_codec

# User-facing aliases ("auto" is resolved by `auto_cache_dtype`).
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}


def auto_cache_dtype(linear_dtype: str = "float32") -> str:
    """What "auto" holds: float32 beside exact float32 weights (greedy output equals transformers'), float16
    beside bf16 / int8 / int4 weights, as llama.cpp's default cache. float16 K/V cost nothing measurable
    on the embedded model (bench/kv_quant_accuracy.py: perplexity -0.000%, KL 3.7e-7, top-1 99.96%) and
    halve both the memory and what a decode step reads (W2 TPOT 9.2 -> 7.7 ms, W4 13.5 -> 11.6 ms with
    int4 weights, AMD EPYC)."""
    return "float32" if linear_dtype == "float32" else "float16"


def resolve_cache_dtype(name: str, linear_dtype: str = "float32") -> str:
    """Map a user-facing cache dtype to a canonical one; "auto" by the linear layers' dtype (`auto_cache_dtype`).

    "K/V" gives keys and values different dtypes (llama.cpp's --cache-type-k /
    --cache-type-v), e.g. "int8/int4": keys carry the attention pattern and
    suffer more from coarse quantization than values.
    """
    if "/" in name:
        k, _, v = name.partition("/")
        k, v = resolve_cache_dtype(k, linear_dtype), resolve_cache_dtype(v, linear_dtype)
        return k if k == v else f"{k}/{v}"
    resolved = auto_cache_dtype(linear_dtype) if name == "auto" else _ALIASES.get(name, name)
    if resolved not in CODECS:
        raise InvalidRequestError(f"unsupported KV cache dtype {name!r}; choose one of: auto, {', '.join(CODECS)} "
                                  f"(or K/V, e.g. int8/int4)")
    return resolved


@dataclass(frozen=True, slots=True)
class KVSpec:
    """KV-cache geometry of one model at one cache dtype.

    `bytes_per_token` counts every layer: what a token costs where every layer
    keeps it. With sliding-window layers, the pool is paged per KV group
    (kv/groups/layout.py): a page holds `page_layers` layers, and a request holds
    fewer pages in windowed groups (`request_bytes`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # canonical: "int8", or "int8/int4" for different K and V dtypes
    # Each layer's sliding window (None = full attention); empty: every layer full.
    layer_windows: tuple[int | None, ...] = ()
    # Where layers differ in K/V shape (Gemma 4; kv/cache/packing.py), `num_layers` counts the pool's slots
    # (each `num_kv_heads` rows of `head_dim` per side, one window each) and these say what is in them: each
    # stored layer's own shape and its first slot (it spans `slots_needed`); empty: every layer is plain, one
    # slot each.
    layer_kv: tuple[LayerKV, ...] = ()
    layer_first_slot: tuple[int, ...] = ()
    layer_row_offset: tuple[int, ...] = ()  # where in its slot a layer smaller than a slot starts (both sides)
    # Attention layer -> the stored layer it reads (layers that share another's cache store none); empty:
    # attention layer i is stored layer i.
    layer_sources: tuple[int, ...] = ()

    def stored_layer(self, attention_layer: int) -> int:
        """The stored layer attention layer `attention_layer` writes or reads."""
        return self.layer_sources[attention_layer] if self.layer_sources else attention_layer

    def slots_of(self, layer: int) -> range:
        """The pool slots stored layer `layer` spans."""
        if not self.layer_kv:
            return range(layer, layer + 1)
        first = self.layer_first_slot[layer]
        return range(first, first + slots_needed(self.layer_kv[layer], self.num_kv_heads, self.head_dim))

    def packed(self, layer: int) -> LayerKV | None:
        """Stored layer `layer`'s own shape where it is packed into the pool's rows; None where it is plain."""
        if not self.layer_kv or is_plain(self.layer_kv[layer], self.num_kv_heads, self.head_dim):
            return None
        return self.layer_kv[layer]

    def rows_of(self, layer: int) -> range:
        """The rows (per side) stored layer `layer` takes in each of its slots."""
        if not self.layer_kv:
            return range(self.num_kv_heads)
        offset = self.layer_row_offset[layer]
        return range(offset, offset + rows_used(self.layer_kv[layer], self.num_kv_heads, self.head_dim))

    def slot_units(self) -> list[tuple[range, list[int]]]:
        """The pool's slots in units moved together, each with the stored layers in it: a slot and the layers
        sharing it, or the slots one layer spans."""
        units: dict[int, tuple[range, list[int]]] = {}
        for layer in range(self.num_stored_layers):
            slots = self.slots_of(layer)
            units.setdefault(slots[0], (slots, []))[1].append(layer)
        return [units[first] for first in sorted(units)]

    @property
    def attention_layer_windows(self) -> tuple[int | None, ...]:
        """Each attention layer's window as the pool lays it out (the window of the slots it reads)."""
        layout = self.layout
        return tuple(layout.groups[layout.layer_group[self.slots_of(self.stored_layer(layer))[0]]].window
                     for layer in range(self.num_attention_layers))

    @property
    def num_stored_layers(self) -> int:
        return len(self.layer_kv) if self.layer_kv else self.num_layers

    @property
    def num_attention_layers(self) -> int:
        return len(self.layer_sources) if self.layer_sources else self.num_stored_layers

    @property
    def layout(self) -> KVGroupLayout:
        return kv_group_layout(self.layer_windows or (None,) * self.num_layers)

    @property
    def k_codec(self) -> KVCodec:
        return key_codec(self.dtype.partition("/")[0])

    @property
    def v_codec(self) -> KVCodec:
        return CODECS[self.dtype.partition("/")[2] or self.dtype]

    def token_bytes_per_layer(self, block_size: int = REFERENCE_BLOCK) -> int:
        """One K row and one V row per KV head: elements plus quantization parameters (a blockwise codec's
        share of its block's: they depend on the block size)."""
        return self.num_kv_heads * (self.k_codec.bytes_per_row(self.head_dim, block_size)
                                    + self.v_codec.bytes_per_row(self.head_dim, block_size))

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.token_bytes_per_layer()

    @property
    def bytes_per_token(self) -> int:
        """Every layer's bytes for one token, in blocks of REFERENCE_BLOCK tokens (the default)."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def has_open_blocks(self) -> bool:
        """Whether blocks are encoded only when full (a blockwise codec): the pool then keeps each block still
        being filled in float16 (kv/cache/open_blocks.py), one per request and KV group."""
        return self.k_codec.blockwise or self.v_codec.blockwise

    def open_block_bytes(self, block_size: int) -> int:
        """One open block's float16 K and V (a page's layers); 0 without blockwise codecs."""
        if not self.has_open_blocks:
            return 0
        return 2 * self.page_layers * self.num_kv_heads * block_size * self.head_dim * OPEN_BLOCK_DTYPE.itemsize

    def open_slots(self, max_num_seqs: int) -> int:
        """Open blocks the pool keeps room for: one per request of a full batch and KV group."""
        return max_num_seqs * self.layout.num_groups if self.has_open_blocks else 0

    def open_blocks_bytes(self, max_num_seqs: int, block_size: int, num_pages: int | None = None) -> int:
        """What the open blocks of `max_num_seqs` requests take beside the pages (0 without them); never more
        than one per page of a pool of `num_pages`."""
        slots = self.open_slots(max_num_seqs)
        return (slots if num_pages is None else min(slots, num_pages)) * self.open_block_bytes(block_size)

    def pool_pages(self, budget: int, block_size: int, max_num_seqs: int) -> int:
        """The most pages that fit in `budget` bytes beside their open blocks (the pool keeps one per page
        at most, up to `open_slots(max_num_seqs)`)."""
        page, slot, slots = self.page_bytes(block_size), self.open_block_bytes(block_size), self.open_slots(max_num_seqs)
        beside_all = (budget - slots * slot) // page
        return beside_all if beside_all >= slots else budget // (page + slot)

    @property
    def page_layers(self) -> int:
        return self.layout.page_layers

    def page_bytes(self, block_size: int) -> int:
        """One pool page: `block_size` tokens of `page_layers` layers (one group's block)."""
        return block_size * self.page_layers * self.token_bytes_per_layer(block_size)

    def request_pages(self, num_tokens: int, block_size: int) -> int:
        """Pages a request with `num_tokens` computed holds between steps, over every group."""
        return sum(blocks_held(window, num_tokens, block_size) for window in self.layout.windows)

    def request_bytes(self, num_tokens: int, block_size: int) -> int:
        """KV bytes a request with `num_tokens` computed holds between steps: whole pages, windows freed."""
        return self.request_pages(num_tokens, block_size) * self.page_bytes(block_size)

    def compressed_request_bytes(self, num_slots: int, num_tokens: int, block_size: int) -> int:
        """KV bytes a request compressed by KV compression holds: `num_slots` in each full-attention group (its
        kept slots), `num_tokens` in a windowed one (which keeps its window, uncompressed)."""
        pages = sum(blocks_held(None, num_slots, block_size) if window is None
                    else blocks_held(window, num_tokens, block_size) for window in self.layout.windows)
        return pages * self.page_bytes(block_size)

    def formula(self, block_size: int = REFERENCE_BLOCK) -> str:
        """The factors, e.g. '2 (K, V) x 30 layers x 3 KV heads x (64 x 1 B + 2 B scale) = 11,880 bytes/token'."""
        def row(codec: KVCodec) -> str:
            element = f"{self.head_dim} x {codec.bits / 8:g} B"
            params = codec.num_params(self.head_dim, block_size)
            if not params:
                return element
            per = " per channel and block" if codec.blockwise else ""
            return f"({element} + {params * PARAM_DTYPE.itemsize} B {'scale' if params == 1 else 'scales/mins'}{per})"

        k_row, v_row = row(self.k_codec), row(self.v_codec)
        layout = f"2 (K, V) x {k_row}" if k_row == v_row else f"(K {k_row} + V {v_row})"
        total = f"{self.num_layers * self.token_bytes_per_layer(block_size):,} bytes/token"
        if not self.layer_kv:
            return f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {layout} = {total}"
        shared = self.num_attention_layers - self.num_stored_layers
        layers = f"{self.num_stored_layers} stored layers" + (f" ({shared} more read another's)" if shared else "")
        k_eq_v = sum(layer.k_eq_v for layer in self.layer_kv)
        kinds = f", {k_eq_v} of them K = V (V alone)" if k_eq_v else ""
        rows = f"{self.num_kv_heads} row{'s' if self.num_kv_heads > 1 else ''}"
        return f"{layers}{kinds} in {self.num_layers} slots x {rows} x {layout} = {total}"

    def padding_bytes_per_token(self, block_size: int = REFERENCE_BLOCK) -> int:
        """Bytes per token the uniform rows hold beyond what each stored layer fills (kv/cache/packing.py)."""
        row_bytes = self.token_bytes_per_layer(block_size) // (2 * self.num_kv_heads)
        used = sum(sum(side_rows(layer, self.head_dim)) for layer in self.layer_kv)
        return (2 * self.num_kv_heads * self.num_layers - used) * row_bytes if self.layer_kv else 0


def kv_spec(config: ModelConfig, dtype: str = "auto", linear_dtype: str = "float32") -> KVSpec:
    """The spec at cache dtype `dtype` ("auto": by `linear_dtype`, what the linear layers hold)."""
    attention = config.attention_layers  # a hybrid model's recurrent layers keep no K/V (kv/state/)
    stored = config.kv_storing_layers  # attention layers; a layer reading another's cache keeps none
    windows = tuple(config.window_for_layer(attention[layer]) for layer in stored)
    dtype = resolve_cache_dtype(dtype, linear_dtype)
    windows = windows if any(window is not None for window in windows) else ()
    if config.layer_kv_shapes is None and config.layer_k_eq_v is None and config.kv_source_layers is None:
        return KVSpec(len(stored), config.num_kv_heads, config.head_dim, dtype, windows)
    layer_kv = tuple(LayerKV(*config.kv_shape_of(layer), config.k_eq_v_of(layer)) for layer in stored)
    rows, width = row_geometry(layer_kv)
    blockwise = key_codec(dtype.partition("/")[0]).blockwise or CODECS[dtype.partition("/")[2] or dtype].blockwise
    placements, slot_windows = place_layers(layer_kv, [config.window_for_layer(attention[layer]) for layer in stored],
                                            rows, width, share_slots=not blockwise)
    windows = tuple(slot_windows) if any(window is not None for window in slot_windows) else ()
    sources = tuple(stored.index(config.kv_source_of(layer)) for layer in range(len(attention)))
    return KVSpec(len(slot_windows), rows, width, dtype, windows, layer_kv,
                  tuple(slot for slot, _ in placements), tuple(offset for _, offset in placements), sources)


def kv_bytes_per_token(config: ModelConfig, dtype: str = "auto", linear_dtype: str = "float32") -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + quantization parameters)."""
    return kv_spec(config, dtype, linear_dtype).bytes_per_token
