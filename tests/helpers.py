"""Tiny random-weight models for tests, built in process with transformers (the reference)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.dense_variants import DENSE_VARIANTS
from tests.gemma4_variants import GEMMA4_VARIANTS, write_gemma4_gguf  # noqa: F401 (exported for the tests)
from tests.qwen35_variants import QWEN35_VARIANTS, write_qwen35_gguf  # noqa: F401 (exported for the tests)

TINY_VOCAB = 160

# family -> (transformers config class name, model class name, config overrides)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    # Six layers: enough for the tests to give them Gemma 3-like mixed windows (kinds of several layers each).
    "llama-6-layers": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6)),
    # One layer: its K/V depend on the token and its position only, so a context shift's re-rotated cache
    # equals a recompute of the shifted context (tests/engine/test_context_shift.py).
    "llama-1-layer": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
}
# The second family, apart: the tests over VARIANTS check Llama-family specifics.
GEMMA3_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Gemma 3: 8 layers, so both kinds appear (sliding 0-4 and 6-7, global 5), a window shorter than the
    # test sequences; query_pre_attn_scalar = head_dim and the default local base, as llama.cpp assumes.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, attn_implementation="eager")),
    # ... MQA, linear RoPE scaling on the global layers, final logit soft-capping (all in a GGUF's terms too)
    "gemma3-mqa-scaled": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=6, rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=2.0,
        attn_implementation="eager")),
    # ... and what only a config.json can say: explicit layer types, both RoPE bases, a query_pre_attn_scalar
    # other than head_dim.
    "gemma3-custom": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=40,
        sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 5000.0}},
        attn_implementation="eager")),
}
# Qwen3 and Qwen3-MoE (kvserve.model.qwen3): head_dim decoupled from hidden / heads (64 / 4 = 16) in most.
QWEN3_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3-tied-mqa": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True)),
    # Every layer sparse: 8 experts of 32, the top 2 renormalised (as llama.cpp runs a qwen3moe file).
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True)),
    # ... and the top 3 of 6 as the softmax gives them (Qwen1.5-MoE style: not renormalised).
    "qwen3-moe-unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=64, norm_topk_prob=False)),
}

# Hybrid models: recurrent layers among the attention ones (ModelConfig.layer_kinds).
HYBRID_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {}
# LFM2 (kvserve.model.lfm2): short-convolution layers around two attention layers; the MLP width derived from
# block_ff_dim (128 -> 2/3 -> rounded up to 32: 96); tied embeddings, GQA. GGUF twin: tests/lfm2_gguf.py.
# Weights of std 0.1, not 0.02: at 0.02 every greedy continuation is one token repeated.
HYBRID_VARIANTS["lfm2"] = ("Lfm2Config", "Lfm2ForCausalLM", dict(
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, block_multiple_of=32, norm_eps=1e-5,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv"], initializer_range=0.1))
# ... with biases in the convolutions, a kernel of 4, the width as given, untied, MHA, attention first.
HYBRID_VARIANTS["lfm2-bias"] = ("Lfm2Config", "Lfm2ForCausalLM", dict(
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, block_auto_adjust_ff_dim=False,
    conv_bias=True, conv_L_cache=4, tie_word_embeddings=False,
    layer_types=["full_attention", "conv", "conv", "full_attention"], initializer_range=0.1))
# Qwen3.5 and Qwen3.5-MoE (kvserve.model.qwen35): Gated DeltaNet layers beside gated full attention
# (tests/qwen35_variants.py, with its GGUF twin writer).
HYBRID_VARIANTS.update(QWEN35_VARIANTS)


# Widths K-quant super-blocks divide (256 inputs): a file of Q4_K / Q6_K matrices.
WIDE_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-wide": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
}


def build_hf_model(variant: str, seed: int = 0):
    import transformers

    config_name, model_name, overrides = {**VARIANTS, **GEMMA3_VARIANTS, **QWEN3_VARIANTS, **DENSE_VARIANTS,
                                          **WIDE_VARIANTS, **HYBRID_VARIANTS, **GEMMA4_VARIANTS}[variant]
    kwargs = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the test
    # would notice a norm or bias that is loaded wrongly.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hf_model(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def reference_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids`: a plain argmax loop over its KV cache.

    Not `generate(min_new_tokens=...)`, which would mask EOS, while ignore_eos
    (vLLM's meaning) only keeps going past it.
    """
    out: list[int] = []
    past = None
    step_input = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step_input = torch.tensor([[out[-1]]])
    return out


def _permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to Q/K rows (for its interleaved RoPE).
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_LLAMA_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# llama.cpp's gguf-py tensor map for MODEL_ARCH.GEMMA3
_GEMMA3_GGUF_LAYER_NAMES = {
    **_LLAMA_GGUF_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}

# llama.cpp's gguf-py tensor map for MODEL_ARCH.QWEN3 / QWEN3MOE (its stacked experts: `_split_experts`)
_QWEN3_GGUF_LAYER_NAMES = {
    **_LLAMA_GGUF_LAYER_NAMES,
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_GGUF_ARCH = {"gemma3_text": "gemma3", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def _split_experts(hf_name: str, tensor: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """(HF name, llama.cpp layer name, tensor) of one state-dict entry: transformers holds a layer's experts
    as gate_up_proj [E, 2I, H] and down_proj [E, H, I]; llama.cpp as ffn_gate_exps, ffn_up_exps, ffn_down_exps."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return [(hf_name, "ffn_gate_exps.weight", gate), (hf_name, "ffn_up_exps.weight", up)]
    if hf_name.endswith("mlp.experts.down_proj"):
        return [(hf_name, "ffn_down_exps.weight", tensor)]
    return [(hf_name, "", tensor)]


def write_gguf(model, path: Path, quant_types: dict[str, str], tokenizer_metadata: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Write a transformers Llama, Gemma 3, Qwen3 or Qwen3-MoE model as a llama.cpp-style GGUF file.

    `quant_types` maps a substring of the HF weight name to a GGML type name
    ("Q8_0", "Q4_1", ...); other 2-D weights are F32. Returns the weights as
    the file holds them, dequantized by the gguf package, in Hugging Face's
    terms (the reference). Gemma 3 is written as llama.cpp's converter does:
    norms stored as 1 + w, Q/K unpermuted, the global layers' RoPE base and
    scaling only (llama.cpp fixes the layer pattern and the local base).
    """
    import gguf
    from gguf.quants import dequantize, quantize

    from kvserve.kernels.kquant_packing import KQUANT_KINDS
    from kvserve.kernels.kquant_quantize import quantize_kquant

    cfg = model.config
    gemma = cfg.model_type == "gemma3_text"
    qwen3 = cfg.model_type in ("qwen3", "qwen3_moe")  # NEOX RoPE: Q/K unpermuted
    writer = gguf.GGUFWriter(str(path), _GGUF_ARCH.get(cfg.model_type, "llama"))
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters["full_attention"] if gemma else cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if gemma:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if qwen3:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if cfg.model_type == "qwen3_moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for key, value in (tokenizer_metadata or {}).items():
        writer.add_key_value(key, value[0], value[1])

    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = _GEMMA3_GGUF_LAYER_NAMES if gemma else _QWEN3_GGUF_LAYER_NAMES if qwen3 else _LLAMA_GGUF_LAYER_NAMES
    pieces: dict[str, list[torch.Tensor]] = {}  # HF name -> what the file holds of it (experts: gate, up)
    for state_name, state_tensor in model.state_dict().items():
        if state_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        for hf_name, expert_name, tensor in _split_experts(state_name, state_tensor):
            if hf_name in names:
                gguf_name = names[hf_name]
            else:
                _, _, index, rest = hf_name.split(".", 3)
                gguf_name = f"blk.{index}.{expert_name or layer_names[rest]}"
            data = tensor.float().contiguous().numpy()
            qtype = next((t for key, t in quant_types.items() if key in hf_name), "F32") if data.ndim >= 2 else "F32"
            stored = data
            if gemma and hf_name.endswith("norm.weight"):
                stored = data + 1  # Gemma3RMSNorm scales by (1 + w)
            elif not (gemma or qwen3) and "q_proj" in hf_name:
                stored = _permute_for_gguf(data, cfg.num_attention_heads)
            elif not (gemma or qwen3) and "k_proj" in hf_name:
                stored = _permute_for_gguf(data, cfg.num_key_value_heads)
            if qtype == "F32":
                writer.add_tensor(gguf_name, np.ascontiguousarray(stored))
                # a Gemma norm in Hugging Face's terms is what the file holds, less 1
                shifted = gemma and hf_name.endswith("norm.weight")
                held = torch.from_numpy(stored - 1) if shifted else tensor.float().clone()
            else:
                ggml_type = gguf.GGMLQuantizationType[qtype]
                quantizer = quantize
                if qtype in KQUANT_KINDS:  # the gguf package has no K-quant quantizer: kvserve's
                    def quantizer(values, _, kind=qtype):  # stacked experts: row by row all the same
                        rows = torch.from_numpy(np.ascontiguousarray(values)).reshape(-1, values.shape[-1])
                        return quantize_kquant(rows, kind).numpy().reshape(*values.shape[:-1], -1)
                packed = quantizer(np.ascontiguousarray(stored), ggml_type)
                writer.add_tensor(gguf_name, packed, raw_dtype=ggml_type)
                # Quantization blocks lie within rows, so quantizing commutes with the row permutation.
                held = torch.from_numpy(dequantize(quantizer(data, ggml_type), ggml_type).copy()).view(data.shape)
            pieces.setdefault(hf_name, []).append(held)
    reference = {name: parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for name, parts in pieces.items()}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def paged_logits(model, token_ids: list[int], chunks: list[int], block_size: int = 4,
                 cache_dtype: str = "auto") -> torch.Tensor:
    """Run one sequence through the paged cache (of `cache_dtype`) in steps of `chunks` tokens (then 1 per step).

    Each KV group's block table is a scrambled subset of the pool, disjoint from the other groups', so
    wrong addressing cannot pass by luck. A hybrid model's recurrent layers keep their state in slot 1 of a
    state cache between steps. Returns the logits of every position, step by step.
    """
    from kvserve.kv.attention import CpuAttentionBackend, SequenceSlice
    from kvserve.kv.cache.kv_spec import kv_spec
    from kvserve.kv.state.context import StateSequence
    from kvserve.kv.state.state_spec import state_spec
    from kvserve.kv.state.storage import StateCache

    backend = CpuAttentionBackend()
    # The model's own windows (a test may give a layer one the config does not have).
    spec = replace(kv_spec(model.config, cache_dtype), layer_windows=tuple(model.layer_windows))
    num_groups = spec.layout.num_groups
    num_blocks = -(-len(token_ids) // block_size)
    pool_blocks = num_blocks * num_groups * 2 + 1
    cache = backend.allocate_kv_cache(spec, pool_blocks, block_size)
    scrambled = torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [scrambled[g * num_blocks : (g + 1) * num_blocks] for g in range(num_groups)]
    cache.initialize_blocks_through(max(max(table) for table in tables))
    for tensor in cache.k + cache.v:
        # Rows not yet written hold stale data (zeroed once, then reused blocks'
        # leftovers): large finite garbage that must never influence a result.
        tensor.fill_(1e4)
    state_cache = StateCache(state_spec(model.config), 2) if model.has_recurrent_state else None
    rows, computed = [], 0
    steps = list(chunks) + [1] * (len(token_ids) - sum(chunks))
    for count in steps:
        context = backend.build_context(cache, [SequenceSlice(tables, computed, count)])
        ids = torch.tensor(token_ids[computed : computed + count])
        states = None if state_cache is None else state_cache.context([StateSequence(0, count, computed, 1)])
        rows.append(model(ids, torch.arange(computed, computed + count), context, states=states))
        computed += count
    return torch.cat(rows)


def write_tokens(cache, layer: int, block_ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """What earlier steps wrote: K/V of positions start.. of a request with these blocks, into `layer`."""
    from kvserve.kv.attention import SequenceSlice, build_attention_metadata
    from kvserve.kv.attention.cpu import slot_indices

    meta = build_attention_metadata([SequenceSlice((block_ids,), start, k.shape[0])], cache.block_size)
    cache.write(layer, slot_indices(meta.slot_blocks, meta.slot_rows, cache.spec.num_kv_heads, cache.block_size), k, v)


def run_to_finals(engine, check_integrity: bool = True) -> dict:
    """Step `engine` until idle; {request id: assembled final output}, block accounting checked after each step."""
    from kvserve.engine.output.types import RequestOutputAssembler

    finals, assembler = {}, RequestOutputAssembler()
    while engine.has_unfinished():
        for delta in engine.step():
            if (final := assembler.add(delta)) is not None:
                finals[final.request_id] = final
        if check_integrity:
            engine.check_integrity()
    return finals


def int8_activation_matmul(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """What kvserve's quantized matmul computes, in float64: x rounded to int8 per group of `group` inputs
    (scale max|x| / 127: 32 for the group-code matmul, 256 for the K-quant one), times the fp32 weight its
    codes stand for."""
    rows, cols = x.shape
    groups = x.view(rows, cols // group, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    rounded = torch.round(groups * inverse) * (amax / 127)
    return rounded.view(rows, cols).double() @ weight.double().T
