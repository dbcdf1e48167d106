"""Tiny random Gemma 4 models (kvserve.model.gemma4): every feature of the text decoder switched on."""

from __future__ import annotations

from typing import Any

_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
          "sliding_attention", "sliding_attention", "full_attention"]

# variant -> (transformers config class name, model class name, config overrides)
GEMMA4_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Gemma 4 E2B/E4B's layout in small: sliding layers (window 8, shorter than the test sequences) and full
    # layers whose heads are wider (32) and fewer (1 KV head) with K = V, proportional RoPE on a quarter of their
    # frequencies, the last two layers reading layers 3's and 2's caches (with double-wide MLPs), per-layer
    # inputs (8 per layer), final logit soft-capping.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=160, final_logit_softcapping=30.0,
        sliding_window=8, layer_types=_TYPES, attn_implementation="eager")),
    # Gemma 4 26B-A4B's in small: a mixture of experts beside every dense MLP (8 experts of 32, the top 2),
    # K = V full layers of their own width, no PLE, no shared layers, untied head.
    "gemma4-moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32, sliding_window=6,
        final_logit_softcapping=30.0, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        attn_implementation="eager")),
}
