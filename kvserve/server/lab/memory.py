"""The memory calculator's one source of figures: `kvserve memory`'s planner, called per query.

The page sends its controls as query parameters (the same names it keeps in
its URL) and shows what comes back, so its numbers are the CLI's to the byte.
Only catalog names, the served model's name or a custom shape are accepted: a
path would let a browser make the server read files. The page opens on the
served model (its own shape, under the name the server reports).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.memory_sizes import format_memory, parse_memory
from kvserve.errors import InvalidRequestError
from kvserve.model.catalog import KNOWN_MODELS, find_known_model, num_parameters
from kvserve.planner import ENGINE_WEIGHTS_DTYPES, WEIGHT_BYTES, MemoryPlan, plan, resolve_model

# What the page offers (any METHOD:RATIO the engine runs is accepted as a query parameter).
KV_COMPRESSIONS = ("none", "auto:2", "auto:4", "knorm:2", "knorm:4", "keydiff:2", "keydiff:4", "streaming:2",
                   "streaming:4")
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2", "int8/int4")
CUSTOM = "custom"


@dataclass(frozen=True)
class ServedModel:
    """The model this server runs, under the name it reports: the calculator's first choice."""

    name: str
    config: ModelConfig


@dataclass(frozen=True)
class MemoryQuery:
    """The calculator's controls. `model` is a catalog name, the served model's name or "custom" (then
    layers, kv_heads and head_dim)."""

    model: str
    context: int | None = None  # None: the model's context
    batch: int = 1
    kv_dtype: str = "float16"
    weights_dtype: str = "float16"
    memory: str | None = None  # e.g. "80GiB"
    block_size: int = 16
    overhead: float = 0.1
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    heads: int | None = None
    params: float | None = None
    kv_compression: str | None = None  # "METHOD:RATIO" (None or "none": off), as `kvserve memory --kv-compression`
    max_tokens: int = 0  # of the context, generated tokens (never compressed)


def catalog(served: ServedModel) -> dict:
    """The presets and choices the page offers: the served model first (`served` names it), then the
    catalog's presets other than it."""
    presets = {name: c for name, c in KNOWN_MODELS.items() if name.lower() != served.name.lower()}
    return {
        "models": [_model_json(name, c) for name, c in {served.name: served.config, **presets}.items()],
        "served": served.name,
        "kv_dtypes": list(KV_DTYPES),
        "weights_dtypes": [*ENGINE_WEIGHTS_DTYPES, *WEIGHT_BYTES],
        "kv_compressions": list(KV_COMPRESSIONS),
    }


def _model_json(name: str, c: ModelConfig) -> dict:
    return {"name": name, "layers": c.num_layers, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "context": c.max_position_embeddings, "params": num_parameters(c),
            "attention": c.attention_kind, "attention_layers": len(c.attention_layers),
            "recurrent_layers": len(c.recurrent_layers)}


def memory_plan(query: MemoryQuery, served: ServedModel) -> dict:
    """The planner's figures (MemoryPlan.to_json, what `kvserve memory --json` prints) plus the same
    numbers formatted as the CLI formats them. Raises InvalidRequestError for impossible inputs."""
    try:
        result = _plan(query, served)
    except InvalidRequestError:
        raise
    except ValueError as exc:  # an impossible custom shape (heads not a multiple of KV heads) and the like
        raise InvalidRequestError(str(exc)) from None
    return {"plan": result.to_json(), "display": _display(result)}


def _display(p: MemoryPlan) -> dict:
    sizes = {key: format_memory(getattr(p, key)) for key in
             ("kv_bytes_per_request", "kv_bytes_total", "weights_bytes", "overhead_bytes", "total_bytes",
              "state_bytes_per_request", "state_bytes_total", "bytes_per_request", "kv_bytes_per_request_unshared",
              "kv_bytes_per_request_compressed", "kv_bytes_total_compressed")}
    if p.memory_bytes is not None:
        sizes["memory_bytes"] = format_memory(p.memory_bytes)
        sizes["kv_room_bytes"] = format_memory(p.kv_room_bytes)
    return sizes


def _plan(query: MemoryQuery, served: ServedModel) -> MemoryPlan:
    if query.model == served.name:  # the shape the server loaded, as `kvserve memory` reads its file
        name, config = served.name, served.config
        num_params = int(query.params) if query.params else num_parameters(config)
    elif query.model == CUSTOM:
        name, config, num_params = resolve_model(None, query.layers, query.kv_heads, query.head_dim, query.heads,
                                                 query.params, query.context)
    else:
        if find_known_model(query.model) is None:
            raise InvalidRequestError(f"unknown model {query.model!r}: choose {served.name!r} (served), one of "
                                      f"{', '.join(KNOWN_MODELS)} or {CUSTOM!r}", param="model")
        name, config, num_params = resolve_model(query.model, params=query.params)
    context = query.context or config.max_position_embeddings
    if not context:
        raise InvalidRequestError("a custom shape needs a context length", param="context")
    try:
        memory_bytes = parse_memory(query.memory) if query.memory else None
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="memory") from None
    return plan(name, config, num_params, context, query.batch, query.kv_dtype, query.block_size,
                query.weights_dtype, memory_bytes, query.overhead, query.kv_compression, query.max_tokens)
