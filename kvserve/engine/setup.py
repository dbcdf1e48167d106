"""Building an engine: every check of a config against this machine and the model, the KV pool's size,
the attention backend, the cache, the KV manager, the lower tiers and the startup log, in one place.

The config's own value checks (ranges, choices) run when an EngineConfig is
made (kvserve/config.py); what needs the machine or the loaded model is
checked here, in the order that fails fastest: the KV budget before the model
loads, the context and the layout right after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import EngineConfig, ModelConfig
from kvserve.memory_sizes import available_memory, format_memory, parse_memory
from kvserve.errors import ConfigError
from kvserve.kernels.build import kernel_state
from kvserve.kv.attention import AttentionBackend, get_attention_backend
from kvserve.kv.cache.fingerprint import cache_fingerprint, tensor_digest
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.cache.kv_spec import KVSpec, kv_spec
from kvserve.kv.cache.storage import PagedKVCache
from kvserve.kv.tiers.connector import TierConnector
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.traffic import TierTraffic
from kvserve.kv.state.manager import RecurrentStates
from kvserve.kv.state.state_spec import StateSpec, state_spec
from kvserve.kv.state.storage import StateCache
from kvserve.model.loader import LoadedModel, load_model
from kvserve.platform import Platform

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an engine is built from; the engine adds the scheduler, runner and output processor."""

    config: EngineConfig
    device: torch.device
    loaded: LoadedModel
    max_model_len: int
    kv_spec: KVSpec
    attention_backend: AttentionBackend
    kv_cache: PagedKVCache
    kv_manager: KVCacheManager
    tiers: TierConnector | None  # the lower tiers, disk first (None: none configured)
    tiering: TierTraffic | None
    prefix_caching: bool  # without a KV cache there is nothing to share: a hit would skip the recompute
    state_cache: StateCache | None = None  # a hybrid model's recurrent-state slots (None: no recurrent layers)


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None,
                       clock: Callable[[], float] | None = None) -> EngineParts:
    """Check, load and allocate; raises ConfigError (before anything heavy where it can)."""
    check_kv_budget(config)  # before the load: an impossible budget fails in a second
    platform = Platform(config.device)
    if not platform.is_cpu:  # the model and its kernels would run somewhere else than the pool: refuse
        raise ConfigError(f"device {config.device!r}: kvserve has attention kernels for the CPU only so far; "
                          f"use device='cpu'")
    platform.tune_process()
    # Which kernels run, in every engine's log (serve, generate, LLM()): a failed build is a warning with its cost.
    kernels = kernel_state()
    (log.warning if kernels.failed else log.info)("kernels: %s", kernels.describe())
    backend = get_attention_backend(config.attention_backend)  # fails before the model loads
    loaded = loaded or load_model(config.model, config.kv_cache_dtype, config.weights_dtype)
    max_model_len = checked_max_model_len(config, loaded.config)
    spec = kv_spec(loaded.config, config.kv_cache_dtype, loaded.linear_dtype)
    check_layout(config, spec, max_model_len)
    states = state_spec(loaded.config)
    if states is not None:
        check_hybrid(config)
    num_state_slots = state_slots(config, states)
    num_blocks = pool_blocks(config, spec, config.kv_cache_bytes - num_state_slots * (states.slot_bytes if states else 0))
    kv_cache = backend.allocate_kv_cache(spec, num_blocks, config.block_size, config.device,
                                         max_num_seqs=config.max_num_seqs)
    state_cache = StateCache(states, num_state_slots, platform.device) if states is not None else None
    prefix_caching = config.enable_prefix_caching and config.enable_kv_cache
    tiers = (TierConnector([open_disk_tier(config, loaded, kv_cache, spec.dtype)])
             if config.kv_disk_path is not None else None)
    kv_manager = KVCacheManager(num_blocks, config.block_size, enable_caching=prefix_caching,
                                max_pinned_fraction=config.max_pinned_fraction, clock=clock,
                                group_windows=spec.layout.windows, tiers=tiers,
                                states=RecurrentStates(num_state_slots, config.block_size, snapshot_blocks(config),
                                                       prefix_caching, states.slot_bytes) if states else None)
    tiering = TierTraffic(tiers, kv_manager, kv_cache) if tiers is not None else None
    parts = EngineParts(config, platform.device, loaded, max_model_len, spec, backend, kv_cache,
                        kv_manager, tiers, tiering, prefix_caching, state_cache)
    log_startup(parts)
    return parts


def open_disk_tier(config: EngineConfig, loaded: LoadedModel, kv_cache: PagedKVCache, kv_dtype: str) -> DiskTier:
    """The disk tier at `config.kv_disk_path`, filed under a fingerprint of this model and cache layout."""
    model = loaded.model
    weights = tensor_digest([*model.named_parameters(), *model.named_buffers()])
    fingerprint = cache_fingerprint(weights, {
        "model_config": loaded.config, "linear_dtype": loaded.linear_dtype, "kv_dtype": kv_dtype,
        "block_size": config.block_size, "block_layout": kv_cache.block_layout(),
    })
    return DiskTier(Path(config.kv_disk_path).expanduser(), parse_memory(config.kv_disk_size), fingerprint,
                    config.block_size, kv_cache.block_nbytes)


def check_kv_budget(config: EngineConfig) -> None:
    """Refuse a kv_cache_memory above the RAM available now, unless overcommit is allowed (then warn).

    The pool is committed lazily, so without this check an impossible budget
    starts fine and fails at OOM once enough blocks are written.
    """
    if config.kv_cache_memory is None:
        return  # the default is a share of what is available
    budget, available = config.kv_cache_bytes, available_memory()
    if budget > available:
        numbers = (f"kv_cache_memory {format_memory(budget)} ({budget:,} bytes) is larger than the memory "
                   f"available, {format_memory(available)} ({available:,} bytes, MemAvailable)")
        if not config.allow_kv_overcommit:
            raise ConfigError(f"{numbers}; lower --kv-cache-memory (kv_cache_memory=), or allow it on purpose "
                              f"with --allow-kv-overcommit (allow_kv_overcommit=True)")
        log.warning("%s; allowed by --allow-kv-overcommit: the process is killed if the pool fills", numbers)


def checked_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context limit: the model's unless set lower; beyond the model's only with RoPE scaling."""
    context = model_config.max_position_embeddings
    if config.max_model_len is None or config.max_model_len <= context:
        return config.max_model_len or context
    rope = model_config.rope_scaling
    if rope.rope_type == "default":
        raise ConfigError(f"max_model_len {config.max_model_len:,} is beyond the model's context of {context:,} "
                          f"tokens and the model configures no RoPE scaling; lower --max-model-len "
                          f"(max_model_len=) to at most {context:,}")
    log.warning("max_model_len %s is beyond the model's context of %s tokens; allowed because the model "
                "configures RoPE scaling (%s, factor %g), but quality past the trained context is not guaranteed",
                f"{config.max_model_len:,}", f"{context:,}", rope.rope_type, rope.factor)
    return config.max_model_len


def check_layout(config: EngineConfig, spec: KVSpec, max_model_len: int) -> None:
    """Features that need a full-attention cache, refused for a model with sliding-window layers."""
    has_windows = spec.layout.has_windows
    if config.kv_disk_path is not None and has_windows:
        raise ConfigError("kv_disk_path: the disk tier holds prefix blocks of full-attention models only; "
                          "this model has sliding-window layers (their blocks are freed behind the window)")
    if config.context_overflow == "shift":
        if has_windows:
            raise ConfigError("context_overflow='shift' re-rotates full-attention caches; this model has "
                              "sliding-window layers, whose windows already bound what they hold")
        if config.keep_tokens > max_model_len // 2:
            raise ConfigError(f"keep_tokens ({config.keep_tokens}) must be at most half the context "
                              f"({max_model_len} tokens): a shift drops half of what is not kept")


def check_hybrid(config: EngineConfig) -> None:
    """Features a hybrid model's recurrent state cannot follow, refused before anything is allocated."""
    if config.kv_disk_path is not None:
        raise ConfigError("kv_disk_path: the disk tier holds K/V blocks; a hybrid model's prefix hit also needs "
                          "the recurrent-state snapshot where it ends, which the tier does not keep, so its "
                          "blocks could never be resumed from")
    if config.context_overflow == "shift":
        raise ConfigError("context_overflow='shift' re-rotates cached keys; a hybrid model's recurrent state has "
                          "every dropped token folded in and cannot drop them")


def snapshot_blocks(config: EngineConfig) -> int:
    """Blocks between a hybrid model's grid snapshots: `state_snapshot_tokens` in whole blocks, at least one."""
    return max(1, config.state_snapshot_tokens // config.block_size)


def state_slots(config: EngineConfig, spec: StateSpec | None) -> int:
    """How many recurrent-state slots `state_cache_fraction` of the budget holds (0 for a model without
    recurrent layers): each running request holds one, the rest keep snapshots for prefix hits."""
    if spec is None:
        return 0
    budget = int(config.kv_cache_bytes * config.state_cache_fraction)
    slots = budget // spec.slot_bytes
    if slots < 2:
        raise ConfigError(f"state_cache_fraction {config.state_cache_fraction:g} of kv_cache_memory "
                          f"({config.kv_cache_bytes:,} bytes) holds {slots} recurrent states of {spec.slot_bytes:,} "
                          f"bytes ({spec.formula()}); a request needs one to run and one more to step without "
                          f"writing over what it read: raise either")
    return slots


def pool_blocks(config: EngineConfig, spec: KVSpec, budget: int | None = None) -> int:
    """How many blocks the KV budget holds (`budget`: what is left of kv_cache_memory for K/V); one block
    is one KV group's page: block_size tokens of page_layers layers."""
    block_bytes = spec.page_bytes(config.block_size)
    if budget is None:
        budget = config.kv_cache_bytes  # the default is a share of what is free after the load
    # Pages, and beside them (int4 keys) the float16 blocks being filled: one per request and KV group.
    num_blocks = spec.pool_pages(budget, config.block_size, config.max_num_seqs)
    if num_blocks < 1:
        raise ConfigError(f"kv_cache_memory of {budget:,} bytes holds no block of {block_bytes:,} bytes "
                          f"({config.block_size} tokens x {spec.layout.page_layers} layers x "
                          f"{spec.bytes_per_token_per_layer:,} bytes/token/layer)")
    return num_blocks


def log_startup(parts: EngineParts) -> None:
    """One line for every KV layout: the pool's geometry, its groups, and what caching does."""
    config, spec, layout = parts.config, parts.kv_spec, parts.kv_spec.layout
    num_blocks = parts.kv_manager.num_blocks
    if layout.num_groups == 1:
        geometry = (f"{num_blocks} blocks x {config.block_size} tokens = {num_blocks * config.block_size} tokens, "
                    f"{spec.bytes_per_token:,} bytes/token ({spec.dtype})")
        groups = ","
    else:  # a block is one group's page
        geometry = (f"{num_blocks} blocks of {config.block_size} tokens x {layout.page_layers} layers "
                    f"({spec.page_bytes(config.block_size):,} bytes each, {spec.dtype})")
        groups = f"; KV groups: {layout.describe()};"
    if layout.has_windows:
        groups += " blocks behind a window are freed;"
    log.info("KV cache: %s, %.1f MiB%s prefix caching %s%s", geometry, parts.kv_cache.bytes_allocated / 2**20,
             groups, "on" if parts.prefix_caching else "off",
             "" if config.enable_kv_cache else "; KV cache DISABLED: every step recomputes every sequence")
    if parts.state_cache is not None:
        states = parts.state_cache.spec
        log.info("recurrent state: %d slots of %s bytes (%s), %.1f MiB: one per running request, the rest "
                 "snapshots every %d blocks for prefix hits", parts.state_cache.num_slots, f"{states.slot_bytes:,}",
                 states.formula(), parts.state_cache.nbytes / 2**20, snapshot_blocks(config))
    if spec.k_codec.is_fp8 or spec.v_codec.is_fp8:
        log.warning("%s KV cache: this CPU has no fp8 arithmetic, so every read converts the gathered blocks "
                    "to float32 in software (works; int8 is as small and faster here)", spec.dtype)
