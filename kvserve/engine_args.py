"""EngineConfig as command-line flags: every engine flag, its type, default, choices and help come from
the field's metadata (config_fields.py) and from the registries, so a new field is a new flag.

vLLM's names (its EngineArgs); shared by every command that builds an Engine (`serve`, `generate`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence

from kvserve.config import EngineConfig
from kvserve.config_fields import ConfigFieldError, flag_names
from kvserve.errors import ConfigError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field that has one, in the field's order, with the field's name as dest."""
    group = parser.add_argument_group("engine")
    flags = flag_names(EngineConfig)
    closed, named = _registry_names()
    for field in dataclasses.fields(EngineConfig):
        if field.name not in flags:
            continue
        choices = field.metadata["choices"] or closed.get(field.name)
        listed = choices or named.get(field.name, ())
        text = field.metadata["help"].format(choices=", ".join(listed), **flags)
        kind = _flag_type(field.type)
        if kind is bool:
            group.add_argument(flags[field.name], dest=field.name, help=_escape(text),
                               action="store_false" if field.default else "store_true")
            continue
        if field.default is not None:
            text += f" (default {field.default})"
        group.add_argument(flags[field.name], dest=field.name, type=kind, default=field.default, choices=choices,
                           help=_escape(text))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags ask for; every static check runs here, before anything loads, and an
    error names the flag (ConfigError)."""
    from kvserve.kv.cache.kv_spec import resolve_cache_dtype

    flags = flag_names(EngineConfig)
    try:
        config = EngineConfig(**{name: getattr(args, name) for name in flags})
    except ConfigFieldError as exc:
        raise ConfigError(exc.for_flag(flags[exc.field])) from None
    # The KV dtypes are kv/cache/kv_spec.py's (a layer above config.py, so EngineConfig cannot check them): an
    # unknown one fails here rather than after the model load.
    resolve_cache_dtype(config.kv_cache_dtype)
    return config


def _registry_names() -> tuple[Mapping[str, Sequence[str]], Mapping[str, Sequence[str]]]:
    """Names the registries know, by field. Attention backends are a closed list (argparse refuses
    others); KV cache dtypes are only listed in the help, since aliases (fp16) and K/V pairs
    (int8/int4) are accepted too and kv/cache/kv_spec.py refuses the rest."""
    from kvserve.kv.attention.registry import attention_backend_names
    from kvserve.kv.cache.quant import CODECS

    return {"attention_backend": tuple(attention_backend_names())}, {"kv_cache_dtype": tuple(CODECS)}


def _flag_type(annotation: object) -> type:
    """bool, int, float or str, from the field's annotation ("int | None" -> int; "int | str" is a
    memory size such as "2GiB", read as text and parsed by EngineConfig)."""
    kinds = {part.strip() for part in str(annotation).split("|")} - {"None"}
    if len(kinds) == 1 and (kind := kinds.pop()) in ("bool", "int", "float"):
        return {"bool": bool, "int": int, "float": float}[kind]
    return str


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %
