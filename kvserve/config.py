"""The two configurations every layer reads: `ModelConfig` (a model's shape, from its GGUF or Hugging Face
config) and `EngineConfig` (how the engine runs it: cache budget, dtypes, batching, prefix caching, tiers,
drafting; each field carries its CLI flag and check, config_fields.py). Memory sizes as text: memory_sizes.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config_fields import a_name, check_fields, engine_arg, fraction, memory_size, positive_int, token_count
from kvserve.errors import ConfigError
from kvserve.memory_sizes import default_kv_cache_memory, parse_memory


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling` / `rope_parameters`.

    `rope_type` is "default", "linear", "llama3", "yarn" or "longrope"; the other fields are used
    only by the types that need them.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the band of dimensions blended between interpolation and extrapolation (in rotations over the
    # original context), whether its ends are rounded to whole dimensions, and the mscale pair of the factor
    # cos and sin are multiplied by.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # LongRoPE (Phi-3): per-frequency divisors, `long_factor` once the context is longer than
    # original_max_position_embeddings, `short_factor` otherwise.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # YaRN / LongRoPE: what cos and sin are multiplied by; None: the type's own rule from `factor`.
    attention_factor: float | None = None


@dataclass(frozen=True, slots=True)
class GatedDeltaNetShape:
    """The shape of a Gated DeltaNet layer (Qwen3.5's linear attention, kvserve.model.gated_deltanet):
    `num_key_heads` query/key heads of `key_head_dim` serve `num_value_heads` value heads of `value_head_dim`,
    after a causal depthwise convolution of `conv_kernel` taps over q, k and v."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Which key head a value head reads, when there are fewer key heads (r value heads each): Hugging Face
    # groups a key head's value heads together (value head j reads key head j // r); llama.cpp's converter
    # reorders them tiled (value head j reads key head j % num_key_heads). The layer runs either order, so a
    # GGUF file's projections load as stored (their quantized rows and columns need no permuting).
    value_heads_tiled: bool = False

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"value heads ({self.num_value_heads}) must be a multiple of key heads "
                             f"({self.num_key_heads})")
        if self.conv_kernel < 2:
            raise ValueError(f"a conv kernel has at least 2 taps, got {self.conv_kernel}")

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k and v side by side."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One layer's state: the convolution's last kernel - 1 inputs, the delta rule's matrix per value head."""
        return ((self.conv_dim, self.conv_kernel - 1),
                (self.num_value_heads, self.key_head_dim, self.value_head_dim))


# Layer kinds of a hybrid model (ModelConfig.layer_kinds).
ATTENTION = "attention"
RECURRENT = "recurrent"


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
    # Partial RoPE (Phi-4-mini): only the first `rotary_dim` channels of each head rotate; None: all head_dim.
    rotary_dim: int | None = None
    # SmolLM3: whether each layer rotates its queries and keys (False: no RoPE there); None: every layer does.
    rope_layers: tuple[bool, ...] | None = None
    # Granite's muP multipliers: the embeddings are multiplied by `embedding_multiplier`, each layer's attention
    # and MLP outputs by `residual_multiplier` before they join the residual stream, and the logits divided by
    # `logits_scaling`; `attention_multiplier` is the attention scale itself (None: the usual one).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # Ministral 3 (Llama 4's attention temperature): a query at position p is multiplied by
    # 1 + beta * log(1 + floor(p / rope_scaling.original_max_position_embeddings)); None: not at all.
    query_temperature_beta: float | None = None
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
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` gated MLPs of `moe_intermediate_size`,
    # of which a softmax router picks `num_experts_per_tok` per token, their weights renormalised to sum to 1
    # when `norm_topk_prob`. 0 experts: a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen3.5-MoE: beside the routed experts, one shared expert (a gated MLP of this size) every token runs, its
    # output weighted by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_intermediate_size: int = 0
    # Hybrid models (Qwen3.5's Gated DeltaNet, LFM2's short convolutions): each layer's kind, ATTENTION (keeps
    # K/V per token in the paged cache) or RECURRENT (keeps a fixed-size state per request); None: every layer
    # attends. `recurrent_state` is the shapes of the float32 tensors one recurrent layer keeps per request
    # (the same for every recurrent layer of a model), e.g. ((conv_dim, kernel - 1), (heads, d_k, d_v)).
    layer_kinds: tuple[str, ...] | None = None
    recurrent_state: tuple[tuple[int, ...], ...] = ()
    # LFM2: whether its short convolutions (in_proj, the convolution, out_proj) carry biases.
    conv_bias: bool = False
    # Qwen3.5: the shape of its recurrent layers (Gated DeltaNet); None for a model without them.
    gated_deltanet: GatedDeltaNetShape | None = None
    # Gemma 4: attention layers whose K/V differ from one another. Each is indexed as the KV cache numbers its
    # layers (attention layer i, `kv.attend(i, ...)`); None: every attention layer is alike.
    # `layer_kv_shapes[i]` = (KV heads, head dim) of attention layer i (None: num_kv_heads, head_dim).
    # `layer_k_eq_v[i]`: its keys are derived from its values (one projection, kv/attention/base.py
    # KeysFromValues), so the cache keeps V alone. `kv_source_layers[i]`: the attention layer whose cache layer i
    # reads (i itself where it stores its own; an earlier layer of the same window and shape where it
    # computes no K/V: Gemma 4's num_kv_shared_layers).
    layer_kv_shapes: tuple[tuple[int, int], ...] | None = None
    layer_k_eq_v: tuple[bool, ...] | None = None
    kv_source_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be an even count of 1..head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"rope_layers has {len(self.rope_layers)} entries for {self.num_layers} layers")
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
        if self.layer_kinds is not None:
            if len(self.layer_kinds) != self.num_layers:
                raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
            if set(self.layer_kinds) - {ATTENTION, RECURRENT}:
                raise ValueError(f"a layer kind is {ATTENTION!r} or {RECURRENT!r}, got {self.layer_kinds}")
            if RECURRENT in self.layer_kinds and not self.recurrent_state:
                raise ValueError("recurrent layers need their state's shapes (recurrent_state)")
        self._check_kv_layers()
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be 1..{self.num_experts}, got {self.num_experts_per_tok}")

    def _check_kv_layers(self) -> None:
        count = len(self.attention_layers)
        for name in ("layer_kv_shapes", "layer_k_eq_v", "kv_source_layers"):
            value = getattr(self, name)
            if value is not None and len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries for {count} attention layers")
        for layer in range(count):
            kv_heads, _ = self.kv_shape_of(layer)
            if self.num_heads % kv_heads:
                raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of attention layer {layer}'s "
                                 f"KV heads ({kv_heads})")
            source = self.kv_source_of(layer)
            if source != layer and not (0 <= source < layer and self.kv_source_of(source) == source
                                        and self.kv_shape_of(source) == self.kv_shape_of(layer)
                                        and self.k_eq_v_of(source) == self.k_eq_v_of(layer)
                                        and self.window_for_layer(self.attention_layers[source])
                                        == self.window_for_layer(self.attention_layers[layer])):
                raise ValueError(f"attention layer {layer} reads layer {source}'s cache: the source must be an "
                                 f"earlier layer that stores its own, of the same shape, K = V and window")

    def kv_shape_of(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of attention layer `layer`."""
        shape = self.layer_kv_shapes[layer] if self.layer_kv_shapes is not None else None
        return shape if shape is not None else (self.num_kv_heads, self.head_dim)

    def k_eq_v_of(self, layer: int) -> bool:
        """Whether attention layer `layer` derives its keys from its values (the cache keeps V alone)."""
        return self.layer_k_eq_v is not None and self.layer_k_eq_v[layer]

    def kv_source_of(self, layer: int) -> int:
        """The attention layer whose cache attention layer `layer` reads (itself unless it shares another's)."""
        return layer if self.kv_source_layers is None else self.kv_source_layers[layer]

    @property
    def kv_storing_layers(self) -> tuple[int, ...]:
        """The attention layers that store K/V of their own (every one, but for layers that read another's)."""
        return tuple(layer for layer in range(len(self.attention_layers)) if self.kv_source_of(layer) == layer)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The model layers that keep K/V (all of them unless the model is hybrid), in order: attention layer i
        of the KV cache is model layer `attention_layers[i]`."""
        if self.layer_kinds is None:
            return tuple(range(self.num_layers))
        return tuple(layer for layer, kind in enumerate(self.layer_kinds) if kind == ATTENTION)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The model layers that keep a recurrent state instead (state layer i is model layer `recurrent_layers[i]`)."""
        if self.layer_kinds is None:
            return ()
        return tuple(layer for layer, kind in enumerate(self.layer_kinds) if kind == RECURRENT)

    def window_for_layer(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None = full attention)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_dim(self) -> int:
        """How many channels of each head RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"


WEIGHTS_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
CONTEXT_OVERFLOW = ("error", "shift")
SPECULATIVE_METHODS = ("auto", "ngram", "suffix", "off")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine arguments, named as in vLLM where vLLM has them. Each field's help, flag and static check are
    its metadata (config_fields.py): the CLI's engine flags are built from them, and the checks run here."""

    model: str | None = field(default=None, metadata=engine_arg(
        "GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)"))
    # kvserve/platform.py knows the device; the engine refuses one without attention kernels (CUDA today)
    # before the model loads, naming what exists.
    device: str = field(default="cpu", metadata=engine_arg(
        "where weights, the KV pool and every step's tensors live: cpu (the only device with kernels so far; "
        "cuda is refused until its attention backend exists)", check=a_name("a device name such as 'cpu'")))
    block_size: int = field(default=16, metadata=engine_arg("tokens per KV block", check=positive_int))
    max_num_seqs: int = field(default=64, metadata=engine_arg("requests in one batch at most", check=positive_int))
    max_num_batched_tokens: int = field(default=2048, metadata=engine_arg(
        "tokens computed per step at most", check=positive_int))
    # A full step of prompt tokens takes seconds on a CPU (2,048 tokens of a 135M model: ~2.5 s on 2 cores), and
    # every other request waits for it: a newcomer's first token, every running stream's next one.
    step_target_ms: int = field(default=150, metadata=engine_arg(
        "while several requests have work, cut a step's prompt tokens to what the engine measured it computes in "
        "about this many milliseconds (a newcomer's first token and every stream's next one wait for at most "
        "about one such step); a lone request still gets {max_num_batched_tokens}; 0 turns it off",
        check=token_count))
    kv_cache_dtype: str = field(default="auto", metadata=engine_arg(
        "what the KV cache holds: auto follows {weights_dtype} (float32 beside float32 weights, float16 beside "
        "bfloat16, int8 or int4 ones), or one of {choices}, or K/V to give keys and values their own (e.g. "
        "int8/int4)"))
    # Ignored when the Engine is given a loaded model (kvserve.model.quantized_linear resolves "auto").
    weights_dtype: str = field(default="auto", metadata=engine_arg(
        "what the linear layers hold: auto (int4 where kvserve's C++ matmul kernel has a SIMD path, int8 for a "
        "GGUF of other quantizations such as K-quants; without the kernel bfloat16 where the CPU has native "
        "bf16 GEMMs, else float32), float32 (exact), bfloat16, int8, int4", choices=WEIGHTS_DTYPES))
    kv_cache_memory: int | str | None = field(default=None, metadata=engine_arg(
        "KV pool size, e.g. 2GiB (default: 30% of free RAM, at most 4 GiB); more than the memory available is "
        "refused unless {allow_kv_overcommit}", check=memory_size(parse_memory)))
    max_model_len: int | None = field(default=None, metadata=engine_arg(
        "context limit (default: the model's; more only if the model configures RoPE scaling)", check=positive_int))
    enable_kv_cache: bool = field(default=True, metadata=engine_arg(
        "recompute every sequence in full every step and keep no KV between steps (the baseline that shows "
        "what the cache buys)", flag="--no-kv-cache"))
    enable_prefix_caching: bool = field(default=True, metadata=engine_arg(
        "do not share the K/V of identical prompt prefixes across requests", flag="--no-prefix-caching"))
    attention_backend: str = field(default="auto", metadata=engine_arg(
        "attention kernels, one of {choices}: auto picks the device's own (cpu on a CPU); cpu runs kvserve's "
        "C++ kernels over the paged cache (decode on fp32, fp16 and bf16 caches; torch kernels for quantized "
        "caches or where no compiler is present); cpu-torch runs torch kernels only",
        check=a_name("a backend name such as 'auto'")))
    # The pool is committed lazily, so an overcommit fails late: at OOM.
    allow_kv_overcommit: bool = field(default=False, metadata=engine_arg(
        "accept a {kv_cache_memory} larger than the memory available (logs a warning)"))
    kv_disk_path: str | None = field(default=None, metadata=engine_arg(
        "a second KV tier on disk in this directory (off by default): prefix blocks are written through to it, "
        "hit again after the pool evicts them, and survive restarts (kv/tiers/disk.py)"))
    kv_disk_size: int | str = field(default="8GiB", metadata=engine_arg(
        "capacity of the disk tier, e.g. 20GiB; least recently used blocks go beyond it",
        check=memory_size(parse_memory)))
    kv_events_endpoint: str | None = field(default=None, metadata=engine_arg(
        "publish the prefix cache's changes on this ZMQ PUB endpoint, as vLLM does (e.g. tcp://*:5557; a "
        "wildcard host, ipc:// or inproc:// binds, another address connects): BlockStored / BlockRemoved / "
        "AllBlocksCleared in vLLM's msgpack schema, for KV-aware routers (needs kvserve[events])"))
    kv_events_replay_endpoint: str | None = field(default=None, metadata=engine_arg(
        "with {kv_events_endpoint}: a ZMQ ROUTER endpoint that resends recent event batches from a sequence "
        "number on (vLLM's replay protocol), e.g. tcp://*:5558"))
    max_pinned_fraction: float = field(default=0.5, metadata=engine_arg(
        "most of the KV pool that pinned prefixes (cache breakpoints with a TTL, kv/prefix/pins.py) may hold; past it "
        "the least recently refreshed pins lapse (pins are evicted last, never \"never\")", check=fraction))
    context_overflow: str = field(default="error", metadata=engine_arg(
        "when a sequence reaches {max_model_len}: error (refuse requests whose prompt + max_tokens exceed it) "
        "or shift (drop the oldest tokens after the first {keep_tokens} and re-rotate the kept keys, as "
        "llama.cpp's context shift does, so generation goes on)", choices=CONTEXT_OVERFLOW))
    keep_tokens: int = field(default=4, metadata=engine_arg(
        "with {context_overflow} shift: leading tokens never dropped (attention sinks, a system prompt)",
        check=token_count))
    state_cache_fraction: float = field(default=0.5, metadata=engine_arg(
        "a hybrid model's (Qwen3.5, LFM2) share of {kv_cache_memory} for recurrent states: each running "
        "request's live state and the snapshots prefix hits resume from (the rest holds the attention layers' "
        "K/V blocks; ignored for other models)", check=fraction))
    state_snapshot_tokens: int = field(default=128, metadata=engine_arg(
        "a hybrid model's recurrent state is snapshotted every this many tokens along a sequence (rounded down to "
        "whole blocks, at least one; besides the end of each step and where a hit's blocks fork), for prefix hits",
        check=positive_int))
    speculative: str = field(default="auto", metadata=engine_arg(
        "speculative decoding without a draft model, verified exactly (greedy output unchanged, sampling "
        "distribution unchanged): ngram (prompt lookup: drafts copied from the request's own tokens), suffix "
        "(also from the tenant's past outputs), off, or auto (suffix, each request drafting only while its "
        "measured acceptance pays for the verify's extra cost at the current batch size)",
        choices=SPECULATIVE_METHODS))
    num_speculative_tokens: int = field(default=8, metadata=engine_arg(
        "most tokens drafted per request per step with {speculative} (each request's k adapts below it)",
        check=positive_int))
    kv_compression: str | None = field(default=None, metadata=engine_arg(
        "compress each request's prompt KV cache as METHOD:RATIO (streaming, knorm, keydiff, or auto = knorm; e.g. "
        "knorm:2): every 512-token chunk the prompt goes on past keeps ceil(512 / RATIO) tokens per layer and KV "
        "head (whole blocks), chosen from its keys; full-attention models; a request's kv_compression overrides it "
        "(\"none\": off)"))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.context_overflow == "shift" and not self.enable_kv_cache:
            raise ConfigError("context_overflow='shift' moves cached K/V: it needs the KV cache on")
        if self.kv_disk_path is not None and not (self.enable_prefix_caching and self.enable_kv_cache):
            raise ConfigError("kv_disk_path needs the KV cache and prefix caching on: the disk tier holds "
                              "prefix-cache blocks")
        if self.kv_events_endpoint is not None and not (self.enable_prefix_caching and self.enable_kv_cache):
            raise ConfigError("kv_events_endpoint publishes the prefix cache: it needs the KV cache and prefix "
                              "caching on")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("kv_events_replay_endpoint replays the events of kv_events_endpoint: set that too")

    @property
    def kv_cache_bytes(self) -> int:
        return default_kv_cache_memory() if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory)
