"""`kvserve memory`: the sizing formula as a tool.

total = (weights + KV) x (1 + overhead), with
KV per request = ceil(context / block_size) x block_size x bytes_per_token and
bytes_per_token = layers x KV heads x (K row + V row), from `kv_spec`, the
function the engine allocates its pool with. So the KV figures here are the
bytes the engine would reserve for those requests, to the byte.

With sliding-window layers the pool is paged per KV group (kv/groups/layout.py) and
a windowed group holds only the blocks of its window: KV per request is then
`KVSpec.request_bytes`, what the allocator holds for a request of `context`
tokens between steps; the figure without that freeing is reported beside it.

int4 keys are encoded per channel over a whole block, so each request's block
still being filled is kept in float16 beside the pool (kv/cache/open_blocks.py): the
pool reserves one such block per request of a full batch (`max_num_seqs`) and
KV group, counted here for `batch` requests (`KVSpec.open_blocks_bytes`).

A hybrid model (Qwen3.5, LFM2) keeps K/V for its attention layers only, and
for its recurrent layers one fixed-size float32 state per request, whatever its
length (`StateSpec.slot_bytes`, the size of the engine's state slots). A request
then costs its context's K/V plus one live state: that is what the batch, the
requests that fit and the longest context that fits are counted with. (The
engine keeps more slots than running requests, for snapshots that prefix hits
resume from: `--state-cache-fraction` of its cache budget.)

With `--kv-compression METHOD:RATIO` (issue 43) a request's prompt is compressed
in canonical chunks that keep `budget` tokens each, the tail and the generated
tokens whole: its blocks are ChunkPolicy.peak_slots's (kv/compressed_chunks.py,
what the engine's admission uses too), the most it holds at once. The figures
with compression stand beside those without; the largest context is the largest
for which every shorter request fits too (one more prompt token can compress one
more chunk, so a request's blocks do not grow with its length one for one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvserve.arith import round_up
from kvserve.config import WEIGHTS_DTYPES, ModelConfig
from kvserve.memory_sizes import format_memory
from kvserve.errors import InvalidRequestError
from kvserve.kv.cache.kv_spec import KVSpec, kv_spec
from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.compression.engine_spec import OFF, EngineSupport, chunk_policy, engine_spec
from kvserve.kv.state.state_spec import state_spec
from kvserve.model.catalog import KNOWN_MODELS, dense_parameters, find_known_model, num_parameters
from kvserve.model.quantized_linear import held_weight_bytes, resolve_for_config

# Bytes per parameter of formats other engines hold (kvserve's own dtypes are in ENGINE_WEIGHTS_DTYPES).
WEIGHT_BYTES = {"float16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k": 144 / 256}
# What `kvserve serve --weights-dtype` holds, layer by layer (kvserve.model.quantized_linear); "auto" as on this CPU.
ENGINE_WEIGHTS_DTYPES = WEIGHTS_DTYPES


@dataclass
class MemoryPlan:
    model: str
    context: int
    batch: int
    kv_dtype: str
    block_size: int
    bytes_per_token: int
    formula: str
    kv_bytes_per_request: int
    kv_bytes_total: int
    num_parameters: int
    weights_dtype: str
    weights_bytes: int
    overhead_fraction: float
    overhead_bytes: int
    total_bytes: int
    attention: str  # MHA / GQA / MQA
    model_max_context: int
    kv_groups: str  # the KV group layout, e.g. "6 groups of 3 layers: 5 windowed (512 tokens), 1 full attention"
    kv_bytes_per_request_unwindowed: int  # what the request would hold if windowed layers kept every block
    kv_open_blocks_bytes: int  # float16 blocks being filled, for `batch` requests (int4 keys; else 0), in kv total
    memory_bytes: int | None = None
    kv_room_bytes: int | None = None  # what `memory_bytes` leaves for KV after weights and overhead
    max_concurrent_requests: int | None = None  # of `context` tokens, within `memory_bytes`
    max_context_for_batch: int | None = None  # per request, for `batch` requests, within `memory_bytes`
    context_capped_by_model: bool = False  # the budget holds more than the model's context per request
    max_requests_at_max_context: int | None = None  # of `max_context_for_batch` tokens, within `memory_bytes`
    # The layers by kind, and a hybrid model's recurrent state (0 / "" for a model whose every layer attends):
    attention_layers: int = 0  # the layers that keep K/V (`bytes_per_token` counts them)
    recurrent_layers: int = 0  # the layers that keep a fixed-size state per request instead
    state_bytes_per_request: int = 0  # one request's live state over every recurrent layer (float32)
    state_formula: str = ""
    state_bytes_total: int = 0  # `batch` live states (in `total_bytes`, beside `kv_bytes_total`)
    bytes_per_request: int = 0  # what one request of `context` tokens holds: its K/V and its live state
    # Layers that differ (Gemma 4): what one request would hold, and the largest context the budget would take,
    # if every attention layer stored its own K and V (no layer reading another's cache, no K = V); 0 otherwise.
    kv_bytes_per_request_unshared: int = 0
    max_context_unshared: int | None = None
    # KV compression (--kv-compression METHOD:RATIO; "" off): `max_new_tokens` of the context are generated (never
    # compressed), the rest is the prompt. The same figures as above, with compressed chunks keeping their budget.
    kv_compression: str = ""
    max_new_tokens: int = 0
    compressed_chunks_per_request: int = 0  # prompt chunks compressed in a request of `context` tokens
    dropped_tokens_per_request: int = 0  # prompt tokens those chunks drop from the cache
    kv_bytes_per_request_compressed: int = 0  # the most one request holds at once, whole blocks
    kv_bytes_total_compressed: int = 0  # `batch` of them
    max_concurrent_requests_compressed: int | None = None
    max_context_compressed: int | None = None  # every context up to it fits, for `batch` requests

    def to_json(self) -> dict:
        return asdict(self)


def resolve_model(model: str | None, layers: int | None = None, kv_heads: int | None = None,
                  head_dim: int | None = None, heads: int | None = None, params: float | None = None,
                  context: int | None = None) -> tuple[str, ModelConfig, int]:
    """(name, shape, parameter count) from a known name, a GGUF file, an HF directory or custom flags."""
    custom = (layers, kv_heads, head_dim)
    if model is None:
        if any(v is None for v in custom):
            raise InvalidRequestError("give a model (known name, .gguf file or HF directory) "
                                      "or all of --layers, --kv-heads and --head-dim")
        heads = heads or kv_heads
        config = ModelConfig(
            architecture="custom", vocab_size=0, hidden_size=heads * head_dim, intermediate_size=0,
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=context or 0, rms_norm_eps=1e-5, rope_theta=10000.0,
        )
        return "custom", config, int(params or 0)
    config = find_known_model(model) or find_known_model(_base_model_name(model))
    name = model
    if config is None:
        path = Path(model)
        if path.is_dir():
            from kvserve.model.checkpoint import read_config

            config = read_config(path)
        elif path.is_file():
            from kvserve.model.gguf import read_gguf_config

            config = read_gguf_config(path)
        else:
            raise InvalidRequestError(f"unknown model {model!r}: not a known name ({', '.join(KNOWN_MODELS)}), "
                                      f"a .gguf file or a Hugging Face directory")
        name = path.name
    return name, config, int(params) if params else num_parameters(config)


def plan(name: str, config: ModelConfig, num_params: int, context: int, batch: int = 1, kv_dtype: str = "auto",
         block_size: int = 16, weights_dtype: str = "float16", memory_bytes: int | None = None,
         overhead_fraction: float = 0.1, kv_compression: str | None = None, max_new_tokens: int = 0) -> MemoryPlan:
    if context < 1 or batch < 1 or block_size < 1:
        raise InvalidRequestError("context, batch and block size must be >= 1")
    if weights_dtype not in WEIGHT_BYTES and weights_dtype not in ENGINE_WEIGHTS_DTYPES:
        choices = ", ".join([*ENGINE_WEIGHTS_DTYPES, *WEIGHT_BYTES])
        raise InvalidRequestError(f"unknown weights dtype {weights_dtype!r}; choose one of {choices}")
    if not 0 <= overhead_fraction < 10:
        raise InvalidRequestError("overhead must be a fraction in [0, 10)")
    spec = kv_spec(config, kv_dtype, _linear_dtype(config, weights_dtype))
    states = state_spec(config)
    state_bytes = states.slot_bytes if states is not None else 0  # one live state per running request
    per_request = spec.request_bytes(context, block_size)
    open_blocks = spec.open_blocks_bytes(batch, block_size)
    kv_total = batch * per_request + open_blocks
    state_total = batch * state_bytes
    weights = _weight_bytes(config, num_params, weights_dtype)
    overhead = math.ceil((weights + kv_total + state_total) * overhead_fraction)
    result = MemoryPlan(
        model=name, context=context, batch=batch, kv_dtype=spec.dtype, block_size=block_size,
        bytes_per_token=spec.num_layers * spec.token_bytes_per_layer(block_size), formula=spec.formula(block_size), kv_bytes_per_request=per_request,
        kv_bytes_total=kv_total, num_parameters=num_params, weights_dtype=weights_dtype, weights_bytes=weights,
        overhead_fraction=overhead_fraction, overhead_bytes=overhead,
        total_bytes=weights + kv_total + state_total + overhead,
        attention=config.attention_kind, model_max_context=config.max_position_embeddings,
        kv_groups=spec.layout.describe(),
        kv_bytes_per_request_unwindowed=round_up(context, block_size) * spec.token_bytes_per_layer(block_size)
        * spec.num_layers,
        kv_open_blocks_bytes=open_blocks, attention_layers=spec.num_attention_layers,
        recurrent_layers=states.num_layers if states is not None else 0, state_bytes_per_request=state_bytes,
        state_formula=states.formula() if states is not None else "", state_bytes_total=state_total,
        bytes_per_request=per_request + state_bytes,
    )
    unshared = _without_layer_savings(config, kv_dtype, _linear_dtype(config, weights_dtype))
    if unshared is not None:
        result.kv_bytes_per_request_unshared = unshared.request_bytes(context, block_size)
    if memory_bytes is not None:
        # (weights + kv + states) x (1 + overhead) <= memory  ->  kv + states <= memory / (1 + overhead) - weights
        kv_room = max(int(memory_bytes / (1 + overhead_fraction)) - weights, 0)
        result.memory_bytes = memory_bytes
        result.kv_room_bytes = kv_room
        # Each request's blocks being filled, and its live state: both whatever its context.
        fixed_per_request = spec.open_blocks_bytes(1, block_size) + state_bytes
        result.max_concurrent_requests = kv_room // (per_request + fixed_per_request)
        longest = _longest_context(spec, block_size, max(kv_room // batch - fixed_per_request, 0),
                                   config.max_position_embeddings)
        # A model runs at most its own context (serve refuses more without RoPE scaling); a custom shape's
        # context is the one asked for, not a limit, so it is not capped.
        if config.architecture != "custom" and 0 < config.max_position_embeddings < longest:
            longest, result.context_capped_by_model = config.max_position_embeddings, True
        result.max_context_for_batch = longest
        result.max_requests_at_max_context = kv_room // (spec.request_bytes(longest, block_size) + fixed_per_request) \
            if longest else 0
        if unshared is not None:
            result.max_context_unshared = min(_longest_context(
                unshared, block_size, max(kv_room // batch - fixed_per_request, 0), config.max_position_embeddings),
                config.max_position_embeddings or longest)
    if kv_compression is not None and kv_compression.strip().lower() != OFF:
        _plan_compressed(result, spec, kv_compression, max_new_tokens,
                         config.max_position_embeddings if config.architecture != "custom" else 0)
    return result


def _plan_compressed(p: MemoryPlan, spec: KVSpec, text: str, max_new_tokens: int,
                     model_max_context: int) -> None:
    """Fill `p`'s compressed figures. The engine refuses compression for some caches (engine_spec.EngineSupport):
    so does the planner, with the same reason."""
    try:
        compression = engine_spec(text, p.block_size)
    except ValueError as exc:
        raise InvalidRequestError(f"kv_compression: {exc}", param="kv_compression") from None
    why = EngineSupport(only_windows=None not in spec.layout.windows,
                        shared_layers=bool(spec.layer_kv or spec.layer_sources), blockwise_codec=spec.has_open_blocks,
                        context_shift=False).refusal()
    if why is not None:
        raise InvalidRequestError(why, param="kv_compression")
    if not 0 <= max_new_tokens < p.context:
        raise InvalidRequestError("max_new_tokens (generated tokens) must be in [0, context)", param="max_tokens")
    bs = p.block_size

    def policy(context: int) -> ChunkPolicy:
        return chunk_policy(compression, bs, context - max_new_tokens)

    asked = policy(p.context)
    p.kv_compression, p.max_new_tokens = f"{compression.method}:{compression.ratio:g}", max_new_tokens
    p.compressed_chunks_per_request, p.dropped_tokens_per_request = asked.num_chunks, asked.dropped(p.context)
    p.kv_bytes_per_request_compressed = spec.compressed_request_bytes(asked.peak_slots(p.context), p.context, bs)
    p.kv_bytes_total_compressed = p.batch * p.kv_bytes_per_request_compressed
    if p.kv_room_bytes is None:
        return
    p.max_concurrent_requests_compressed = p.kv_room_bytes // p.kv_bytes_per_request_compressed
    room = p.kv_room_bytes // p.batch

    def fits(context: int) -> bool:  # this context and every shorter one
        return spec.compressed_request_bytes(policy(context).worst_peak_slots(max_new_tokens), context, bs) <= room

    lo, hi = max_new_tokens + 1, 2 * max(model_max_context, max_new_tokens + 1)
    if not fits(lo):
        p.max_context_compressed = 0
        return
    while fits(hi):
        if model_max_context:  # a model runs at most its own context (a custom shape's is no limit)
            p.max_context_compressed = model_max_context
            return
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    p.max_context_compressed = min(lo, model_max_context) if model_max_context else lo


def _without_layer_savings(config: ModelConfig, kv_dtype: str, linear_dtype: str) -> KVSpec | None:
    """The KV spec of the same model with every attention layer storing its own K and V (Gemma 4's shared
    layers and K = V undone), to show what they save; None for a model without either."""
    if config.kv_source_layers is None and config.layer_k_eq_v is None:
        return None
    return kv_spec(replace(config, kv_source_layers=None, layer_k_eq_v=None), kv_dtype, linear_dtype)


# Suffixes of the chat-tuned releases of a catalog model: the KV shape is the base model's.
_TUNED_SUFFIXES = ("-instruct", "-chat", "-it")


def _base_model_name(name: str) -> str:
    """'SmolLM2-135M-Instruct' (the name `kvserve serve` reports) -> 'SmolLM2-135M'."""
    lowered = name.lower()
    suffix = next((s for s in _TUNED_SUFFIXES if lowered.endswith(s)), "")
    return name[:len(name) - len(suffix)]


def _longest_context(spec: KVSpec, block_size: int, room: int, model_max_context: int) -> int:
    """The longest context (a multiple of the block size) whose KV fits in `room` bytes. Bytes grow with
    the context, so a binary search over blocks; if only windowed layers hold KV, memory stops bounding the
    context once the windows are full, and the model's own limit is the answer."""
    def fits(blocks: int) -> bool:
        return spec.request_bytes(blocks * block_size, block_size) <= room

    lo, hi = 0, max(model_max_context, 1) // block_size + 1
    if all(window is not None for window in spec.layout.windows) and fits(hi):
        return model_max_context
    while fits(hi):  # a full-attention model's context can exceed what the model was trained for
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * block_size


def _linear_dtype(config: ModelConfig, weights_dtype: str) -> str:
    """What the linear layers hold with `weights_dtype` ("auto" KV follows it): kvserve's dtypes resolved
    as the engine would on this CPU; another format (q4_0, float16 elsewhere) is not float32."""
    return resolve_for_config(config, weights_dtype) if weights_dtype in ENGINE_WEIGHTS_DTYPES else weights_dtype


def _weight_bytes(config: ModelConfig, num_params: int, weights_dtype: str) -> int:
    """kvserve's dtypes: what the engine holds for this shape (scaled if `num_params` was given for a custom
    shape); other formats: bytes per parameter."""
    if weights_dtype in ENGINE_WEIGHTS_DTYPES:  # held_weight_bytes counts every layer as attention: scaled
        return math.ceil(held_weight_bytes(config, weights_dtype) * num_params / dense_parameters(config))
    return math.ceil(num_params * WEIGHT_BYTES[weights_dtype])


def describe(p: MemoryPlan) -> str:
    lines = [
        f"model: {p.model} ({p.attention}"
        + (f" on {p.attention_layers} attention layers, {p.recurrent_layers} recurrent" if p.recurrent_layers else "")
        + f"; {p.num_parameters / 1e9:.2f}B parameters; "
        f"context up to {p.model_max_context:,} tokens)",
        _bytes_per_token_line(p),
        f"KV per request ({p.context:,} tokens, blocks of {p.block_size}): {format_memory(p.kv_bytes_per_request)} "
        f"({p.kv_bytes_per_request:,} bytes)",
        f"KV for the batch ({p.batch} x): {format_memory(p.kv_bytes_total)} ({p.kv_bytes_total:,} bytes)"
        + (f", of which {format_memory(p.kv_open_blocks_bytes)} float16 blocks being filled (one per request and "
           f"KV group: int4 keys are encoded per block)" if p.kv_open_blocks_bytes else ""),
        *_state_lines(p),
        f"weights ({p.weights_dtype}): {format_memory(p.weights_bytes)}",
        f"overhead ({100 * p.overhead_fraction:g}% of weights + {'KV + states' if p.recurrent_layers else 'KV'}): "
        f"{format_memory(p.overhead_bytes)}",
        f"total: {format_memory(p.total_bytes)}",
    ]
    if p.kv_bytes_per_request != p.kv_bytes_per_request_unwindowed:
        lines.insert(3, f"  KV groups: {p.kv_groups}; blocks behind a window are freed "
                        f"(keeping them: {format_memory(p.kv_bytes_per_request_unwindowed)} per request)")
    if p.kv_bytes_per_request_unshared:
        lines.insert(3, f"  every layer storing its own K and V (no layer reading another's cache, no K = V): "
                        f"{format_memory(p.kv_bytes_per_request_unshared)} per request")
    if p.model_max_context and p.context > p.model_max_context:
        lines.append(f"note: {p.context:,} tokens is beyond the model's context of {p.model_max_context:,}")
    if p.memory_bytes is not None:
        fits = "fits" if p.total_bytes <= p.memory_bytes else "does NOT fit"
        lines += [
            f"in {format_memory(p.memory_bytes)}: this plan {fits}; "
            f"{'room for K/V and states' if p.recurrent_layers else 'KV room'} {format_memory(p.kv_room_bytes)}",
            f"  concurrent requests of {p.context:,} tokens: {p.max_concurrent_requests:,}",
            f"  largest context for {p.batch} concurrent request(s): {p.max_context_for_batch:,} tokens",
        ]
        if p.context_capped_by_model:
            lines[-1] += (f" (the model's context; the budget holds {p.max_requests_at_max_context:,} concurrent "
                          f"requests of {p.max_context_for_batch:,} tokens)")
        if p.max_context_unshared is not None:
            lines.append(f"  largest context if every layer stored its own K and V: {p.max_context_unshared:,} tokens")
    return "\n".join(lines + _compression_lines(p))


def _compression_lines(p: MemoryPlan) -> list[str]:
    """The compressed figures beside the plain ones (none without --kv-compression)."""
    if not p.kv_compression:
        return []
    prompt = p.context - p.max_new_tokens
    lines = [
        f"with --kv-compression {p.kv_compression} ({prompt:,} prompt + {p.max_new_tokens:,} generated tokens): "
        f"{p.compressed_chunks_per_request:,} prompt chunk(s) compressed, {p.dropped_tokens_per_request:,} tokens "
        f"dropped",
        f"  KV per request: {format_memory(p.kv_bytes_per_request_compressed)} "
        f"({p.kv_bytes_per_request_compressed:,} bytes, without: {format_memory(p.kv_bytes_per_request)}); "
        f"for the batch: {format_memory(p.kv_bytes_total_compressed)}",
    ]
    if p.max_concurrent_requests_compressed is not None:
        capped = "; the model's context" if p.max_context_compressed == p.model_max_context else ""
        lines += [f"  concurrent requests of {p.context:,} tokens: {p.max_concurrent_requests_compressed:,} "
                  f"(without: {p.max_concurrent_requests:,})",
                  f"  largest context for {p.batch} concurrent request(s): {p.max_context_compressed:,} tokens "
                  f"(without: {p.max_context_for_batch:,}; every shorter one fits too{capped})"]
    return lines


def _bytes_per_token_line(p: MemoryPlan) -> str:
    """The K/V formula; for a hybrid model, both cache kinds side by side: per token and per request."""
    if not p.recurrent_layers:
        return f"KV bytes per token ({p.kv_dtype}): {p.formula}"
    return (f"K/V ({p.kv_dtype}): {p.bytes_per_token:,} bytes/token for {p.attention_layers} attention layers "
            f"({p.formula}) + recurrent state (float32): {p.state_bytes_per_request:,} bytes/request for "
            f"{p.recurrent_layers} recurrent layers ({p.state_formula})")


def _state_lines(p: MemoryPlan) -> list[str]:
    """A hybrid model's live states for the batch, and a request's two kinds together; none otherwise."""
    if not p.recurrent_layers:
        return []
    return [
        f"recurrent state for the batch ({p.batch} x, one live state each): {format_memory(p.state_bytes_total)} "
        f"({p.state_bytes_total:,} bytes); per request, K/V and state: {format_memory(p.bytes_per_request)} "
        f"({p.bytes_per_request:,} bytes)",
    ]
