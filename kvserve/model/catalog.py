"""Shapes of popular models, for planning memory without their weights (`kvserve memory NAME`).

Values from each model's published config.json. Only what sizing needs is
meaningful here (layers, heads, KV heads, head_dim, hidden, intermediate,
vocab, context; for a hybrid model its layer kinds and one recurrent layer's
state shapes); the rest are defaults.
"""

from __future__ import annotations

from dataclasses import replace

from kvserve.config import ATTENTION, RECURRENT, ModelConfig
from kvserve.model import gemma3, gpt_oss, lfm2
from kvserve.model.gemma4_config import Gemma4ModelConfig, gemma4_parameters
from kvserve.model.gemma4_config import read_hf_config as read_gemma4_config


def _shape(layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int, vocab: int,
           context: int, tied: bool = False) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
    )


def gated_deltanet_state(key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                         kernel: int) -> tuple[tuple[int, ...], ...]:
    """A Gated DeltaNet layer's state (Qwen3.5's linear attention): the causal conv's last kernel - 1 inputs
    over q, k and v (conv_dim = 2 x key_heads x key_dim + value_heads x value_dim), and the (key x value)
    matrix each value head accumulates."""
    return (2 * key_heads * key_dim + value_heads * value_dim, kernel - 1), (value_heads, key_dim, value_dim)


def _kinds(num_layers: int, attention: set[int]) -> tuple[str, ...]:
    return tuple(ATTENTION if layer in attention else RECURRENT for layer in range(num_layers))


def _qwen3_5(layers: int, heads: int, kv_heads: int, hidden: int, intermediate: int, key_heads: int,
             value_heads: int) -> ModelConfig:
    """Qwen3.5 (text): full attention every 4th layer (full_attention_interval 4), Gated DeltaNet between
    (linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim 4); head_dim 256."""
    return replace(_shape(layers, heads, kv_heads, 256, hidden, intermediate, 248320, 262144, tied=True),
                   architecture="qwen3_5", rms_norm_eps=1e-6, layer_kinds=_kinds(layers, set(range(3, layers, 4))),
                   recurrent_state=gated_deltanet_state(key_heads, value_heads, 128, 128, 4))


def _lfm2(hidden: int, heads: int, ff_dim: int) -> ModelConfig:
    """LFM2 (350M, 1.2B) read by its own family from the published config.json's values: 16 layers, attention
    at 2, 5, 8, 10, 12, 14 (layer_types), short convs between (conv_L_cache 3), 8 KV heads of 64; the MLP's
    width is block_ff_dim cut to 2/3 and rounded up to 256 (block_auto_adjust_ff_dim)."""
    layer_types = ["full_attention" if layer in (2, 5, 8, 10, 12, 14) else "conv" for layer in range(16)]
    return lfm2.read_hf_config({
        "num_hidden_layers": 16, "num_attention_heads": heads, "num_key_value_heads": 8, "hidden_size": hidden,
        "block_ff_dim": ff_dim, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256, "vocab_size": 65536, "max_position_embeddings": 128000, "conv_L_cache": 3,
        "layer_types": layer_types, "tie_embedding": True, "rope_theta": 1000000.0, "norm_eps": 1e-5}, "lfm2")


def _gemma4(layers: int, hidden: int, kv_heads: int, intermediate: int, pattern: int, shared: int,
            double_wide: bool) -> ModelConfig:
    """Gemma 4 E2B / E4B read by its own family from the published text_config's values: 8 heads, sliding layers
    (window 512) of head_dim 256, every `pattern`-th layer full with head_dim 512 (no K = V on these two), the
    last `shared` layers reading earlier caches, per-layer inputs of 256, 262,144-token vocabulary."""
    return read_gemma4_config({
        "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 256, "global_head_dim": 512,
        "attention_k_eq_v": False, "sliding_window": 512, "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double_wide, "hidden_size_per_layer_input": 256, "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144, "max_position_embeddings": 131072, "final_logit_softcapping": 30.0,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
    }, "Gemma4ForCausalLM")


KNOWN_MODELS: dict[str, ModelConfig] = {
    "Llama-2-7B": _shape(32, 32, 32, 128, 4096, 11008, 32000, 4096),  # MHA
    "Llama-2-13B": _shape(40, 40, 40, 128, 5120, 13824, 32000, 4096),
    "Llama-3.1-8B": _shape(32, 32, 8, 128, 4096, 14336, 128256, 131072),
    "Llama-3.1-70B": _shape(80, 64, 8, 128, 8192, 28672, 128256, 131072),
    "Llama-3.2-1B": _shape(16, 32, 8, 64, 2048, 8192, 128256, 131072, tied=True),
    "Mistral-7B": _shape(32, 32, 8, 128, 4096, 14336, 32768, 32768),  # v0.3
    "Qwen2.5-7B": _shape(28, 28, 4, 128, 3584, 18944, 152064, 131072),
    "Qwen2.5-0.5B": _shape(24, 14, 2, 64, 896, 4864, 151936, 32768, tied=True),
    "SmolLM2-135M": _shape(30, 9, 3, 64, 576, 1536, 49152, 8192, tied=True),
    # Issue 37's dense families (KV depends on layers, KV heads and head_dim alone: none of them has a window
    # that binds; Phi-4-mini's partial RoPE and 262144-token window change nothing here).
    "SmolLM3-3B": replace(_shape(36, 16, 4, 128, 2048, 11008, 128256, 65536, tied=True), architecture="smollm3"),
    "Phi-4-mini": replace(_shape(32, 24, 8, 128, 3072, 8192, 200064, 131072, tied=True), architecture="phi3",
                          rotary_dim=96),
    "OLMo-2-7B": replace(_shape(32, 32, 32, 128, 4096, 11008, 100352, 4096), architecture="olmo2"),
    "Granite-3.3-8B": replace(_shape(40, 32, 8, 128, 4096, 12800, 49159, 131072, tied=True), architecture="granite"),
    # From the packaged GGUF (kvserve.model.loader.gemma3_270m_path): a 512-token window on the layers
    # llama.cpp gives one (five of every six), and its local RoPE base.
    "Gemma-3-270M": replace(
        _shape(18, 4, 1, 256, 640, 2048, 262144, 32768, tied=True), architecture="gemma3", rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, rope_local_theta=gemma3.GGUF_LOCAL_ROPE_THETA, query_pre_attn_scalar=256,
        sliding_window=512, layer_windows=gemma3.gguf_layer_windows(512, 18)),
    # head_dim 128 beside a hidden of 1024 / 16 heads: the KV is counted with 128.
    "Qwen3-0.6B": replace(_shape(28, 16, 8, 128, 1024, 3072, 151936, 40960, tied=True), architecture="qwen3"),
    # 128 experts of 768 in every layer, 8 per token: 30.5B parameters, 3.3B active.
    "Qwen3-30B-A3B": replace(
        _shape(48, 32, 4, 128, 2048, 6144, 151936, 40960), architecture="qwen3moe", num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # Experts of 2,880 (4 per token) in every layer; a 128-token window on every other layer (sinks hold no KV).
    **{name: replace(
        _shape(layers, 64, 8, 64, 2880, 0, 201088, 131072), architecture="gpt-oss", attention_bias=True,
        num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=2880, sliding_window=128,
        layer_windows=gpt_oss.gguf_layer_windows(128, layers))
       for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
    # Hybrid models: K/V for the attention layers only, plus one fixed-size recurrent state per request.
    "Qwen3.5-0.8B": _qwen3_5(24, 8, 2, 1024, 3584, key_heads=16, value_heads=16),
    "Qwen3.5-4B": _qwen3_5(32, 16, 4, 2560, 9216, key_heads=16, value_heads=32),
    "LFM2-350M": _lfm2(1024, 16, 6656),  # an MLP of 4,608
    "LFM2-1.2B": _lfm2(2048, 32, 12288),  # an MLP of 8,192
    # Layers of different K/V shapes (global ones wider), 20 / 18 of them reading an earlier layer's cache.
    "Gemma-4-E2B": _gemma4(35, 1536, 1, 6144, pattern=5, shared=20, double_wide=True),
    "Gemma-4-E4B": _gemma4(42, 2560, 2, 10240, pattern=6, shared=18, double_wide=False),
}


def find_known_model(name: str) -> ModelConfig | None:
    """Case-insensitive lookup by name."""
    by_lower = {key.lower(): value for key, value in KNOWN_MODELS.items()}
    return by_lower.get(name.lower())


def num_parameters(config: ModelConfig) -> int:
    """Weights of a decoder from its shape: `dense_parameters`, with a hybrid model's recurrent layers
    counted as what they are (their mixer instead of attention)."""
    if isinstance(config, Gemma4ModelConfig):
        return gemma4_parameters(config)
    recurrent = len(config.recurrent_layers)
    if not recurrent:
        return dense_parameters(config)
    return (dense_parameters(config) - recurrent * _attention_parameters(config)
            + recurrent * _recurrent_mixer_parameters(config))


def _attention_parameters(config: ModelConfig) -> int:
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return config.hidden_size * (q + 2 * kv) + q * config.hidden_size + ((q + 2 * kv) if config.attention_bias else 0)


def _recurrent_mixer_parameters(config: ModelConfig) -> int:
    """One recurrent layer's mixer, read off its state's shapes for the two kinds kvserve knows (a Gated
    DeltaNet keeps a conv window and a per-head matrix, a short conv its window alone); 0 for another kind.
    Qwen3.5's attention output gate and q/k norms are not counted (a few percent of its weights)."""
    hidden, shapes = config.hidden_size, config.recurrent_state
    if len(shapes) == 2 and len(shapes[1]) == 3:  # Gated DeltaNet: in_proj qkv, z, a, b; conv; out_proj
        (conv_dim, window), (value_heads, _, value_dim) = shapes
        value = value_heads * value_dim
        return (hidden * (conv_dim + value + 2 * value_heads) + conv_dim * (window + 1) + 2 * value_heads
                + value_dim + value * hidden)
    if len(shapes) == 1 and len(shapes[0]) == 2:  # short conv: in_proj (B, C, x), conv, out_proj
        width, window = shapes[0]
        return 3 * width * hidden + width * (window + 1) + width * hidden
    return 0


def dense_parameters(config: ModelConfig) -> int:
    """Weights of a Llama-family decoder from its shape, every layer attending (biases and norms included,
    rotary tables not; per-head q/k norms, a few hundred per layer, not either)."""
    attention = _attention_parameters(config)
    mlp = 3 * config.hidden_size * config.intermediate_size
    if config.num_experts:  # every expert (a token runs num_experts_per_tok of them), and the router
        mlp = config.num_experts * (3 * config.moe_intermediate_size + 1) * config.hidden_size
    per_layer = attention + mlp + 2 * config.hidden_size  # two RMSNorm weights
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + embeddings + config.hidden_size  # final norm
