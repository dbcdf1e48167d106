"""Model-shape configuration shared by every layer of kvserve."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling` / `rope_parameters`.

    `rope_type` is "default", "linear" or "llama3"; the other fields are used
    only by the types that need them.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder, whatever file it came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Mistral-style sliding window: a query attends to the last `sliding_window`
    # positions (itself included). None means full attention.
    sliding_window: int | None = None
    # Per-layer windows where layers differ (Gemma 3: five local layers, then a
    # global one); None means every layer uses `sliding_window`.
    layer_windows: tuple[int | None, ...] | None = None
    # Gemma 3: the windowed layers rotate with their own base (`rope_local_base_freq`) and no
    # scaling; None means they use `rope_theta` and `rope_scaling` like every other layer.
    rope_local_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar**-0.5 (Gemma); None means head_dim**-0.5.
    query_pre_attn_scalar: int | None = None
    # logits = c * tanh(logits / c) (Gemma 2 style); None means no capping.
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.num_layers:
                raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
            bad = next((w for w in self.layer_windows if w is not None and (not isinstance(w, int) or w < 1)), None)
            if bad is not None:
                raise ValueError(f"a layer window must be a positive token count or None, got {bad!r}")

    def window_for_layer(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None = full attention)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"


_MEMORY_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
                 "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_memory(value: int | str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a byte count -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _MEMORY_UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size (e.g. 2GiB, 512MiB, 1000000)")
        amount = int(float(match.group(1)) * _MEMORY_UNITS[unit])
    if amount <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return amount


def format_memory(num_bytes: float) -> str:
    """1536 -> '1.50 KiB': the largest binary unit (up to GiB) that keeps the number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def available_memory() -> int:
    """Bytes of RAM that can be used without swapping: MemAvailable, or free pages off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_cache_memory() -> int:
    """A sensible share of free RAM: 30% of what is available, at most 4 GiB.

    The pool is allocated with torch.empty, so pages are committed only as
    blocks are first written.
    """
    return min(4 * 2**30, int(available_memory() * 0.3))


WEIGHTS_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
CONTEXT_OVERFLOW = ("error", "shift")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine arguments, named as in vLLM where vLLM has them."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    # Where weights, the KV pool and every step's tensors live (kvserve/platform.py knows the device).
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"
    # What the linear layers hold (kvserve.model.quantized_linear): "auto" = int4 (head int8) where the
    # CPU has native bf16 GEMMs, else float32. Ignored when the Engine is given a loaded model.
    weights_dtype: str = "auto"
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"; None: default_kv_cache_memory()
    max_model_len: int | None = None  # None: the model's context length
    # False: every step recomputes each request's whole sequence and keeps no
    # KV between steps (the baseline that shows what the cache buys).
    enable_kv_cache: bool = True
    # Share the K/V of identical prompt prefixes across requests (DESIGN §3).
    enable_prefix_caching: bool = True
    # Attention backend by name (kvserve.kv.attention.registry); "auto" picks
    # the one for the model's device. Unknown names fail when the Engine starts.
    attention_backend: str = "auto"
    # A kv_cache_memory above the RAM available now is refused unless this is
    # set (the pool is committed lazily, so an overcommit fails late: at OOM).
    allow_kv_overcommit: bool = False
    # A second KV tier on disk (kvserve/kv/disk_tier.py): full prefix blocks are written through to
    # this directory and found again after pool evictions and restarts. None: off.
    kv_disk_path: str | None = None
    kv_disk_size: int | str = "8GiB"  # the tier's capacity (least recently used blocks go beyond it)
    # The most of the pool that pinned prefixes (cache breakpoints with a TTL, kv/pins.py) may hold;
    # past it the least recently refreshed pins lapse. Pins are evicted last, never "never".
    max_pinned_fraction: float = 0.5
    # What a running sequence does when it reaches max_model_len: "error" refuses requests that could get
    # there (prompt + max_tokens over the context); "shift" drops the oldest tokens after the first
    # `keep_tokens` (attention sinks, a system prompt) and re-rotates the kept keys, as llama.cpp's context
    # shift does, so generation goes on (engine/context_shift.py).
    context_overflow: str = "error"
    keep_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ConfigError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {self.weights_dtype!r}")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ConfigError(f"attention_backend must be a backend name such as 'auto', got {self.attention_backend!r}")
        for name in ("kv_cache_memory", "kv_disk_size"):
            value = getattr(self, name)
            if value is not None:
                try:
                    parse_memory(value)
                except ValueError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if (not isinstance(self.max_pinned_fraction, (int, float)) or isinstance(self.max_pinned_fraction, bool)
                or not 0 <= self.max_pinned_fraction <= 1):
            raise ConfigError(f"max_pinned_fraction must be between 0 and 1, got {self.max_pinned_fraction!r}")
        if self.context_overflow not in CONTEXT_OVERFLOW:
            raise ConfigError(f"context_overflow must be one of {', '.join(CONTEXT_OVERFLOW)}, "
                              f"got {self.context_overflow!r}")
        if not isinstance(self.keep_tokens, int) or isinstance(self.keep_tokens, bool) or self.keep_tokens < 0:
            raise ConfigError(f"keep_tokens must be a token count >= 0, got {self.keep_tokens!r}")
        if self.context_overflow == "shift" and not self.enable_kv_cache:
            raise ConfigError("context_overflow='shift' moves cached K/V: it needs the KV cache on")
        if self.kv_disk_path is not None and not (self.enable_prefix_caching and self.enable_kv_cache):
            raise ConfigError("kv_disk_path needs the KV cache and prefix caching on: the disk tier holds "
                              "prefix-cache blocks")

    @property
    def kv_cache_bytes(self) -> int:
        return default_kv_cache_memory() if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory)
