"""Checks of an EngineConfig against this machine and the loaded model, made before anything is allocated."""

from __future__ import annotations

import logging

from kvserve.config import EngineConfig, ModelConfig, available_memory, format_memory
from kvserve.errors import ConfigError

log = logging.getLogger(__name__)


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
