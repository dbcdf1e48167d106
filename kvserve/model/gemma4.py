"""The Gemma 4 text decoder (Gemma4ForCausalLM, and Gemma4ForConditionalGeneration's language model; GGUF
`gemma4`) in PyTorch.

Gemma 3's layer (four norms, q/k norms, GELU-tanh gated MLP, sqrt(hidden)-scaled embeddings, sliding and full
layers with their own RoPE, final logit soft-capping) with Gemma 4's differences (gemma4_config.py says what
each config field means):

- the full layers' heads are wider and fewer (their own (KV heads, head_dim): ModelConfig.kv_shape_of), rotate
  with proportional RoPE, and with K = V project keys alone: the cache keeps the values (RMS-normalized, no
  weight), and the attention context derives keys from them (rope(v * k_norm.weight), bit for bit what
  transformers computes: its k_norm is the same normalization times the weight);
- the KV-sharing layers compute no K/V: they attend over their source layer's cache (`kv.attend(i, q, None,
  None, ...)`);
- every norm scales by plain w (not Gemma 3's 1 + w), q is normalized, and scores are not scaled (1.0);
- per-layer inputs (PLE): after its MLP a layer adds proj(gelu(gate(x)) * its per-layer input), normalized;
- each layer's output is multiplied by its `layer_scalar`;
- with experts, a mixture of experts runs beside the dense MLP on the same residual: its router normalizes
  x (no weight), scales it by `router.scale / sqrt(hidden)`, takes the softmax's top k, renormalised and
  multiplied by a per-expert scale; the two outputs are normalized apart and added.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext, ContiguousContext
from kvserve.kv.state.context import StateContext
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily
from kvserve.model.gemma4_config import CONDITIONAL, Gemma4ModelConfig, read_hf_config
from kvserve.model.gemma4_gguf import (GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS, read_gguf_config, tensor_config,
                                      undo_gguf_conversion)
from kvserve.model.layers import (GatedMLP, Linear, MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding,
                                  VocabEmbedding, new_parameter, per_row)
from kvserve.model.moe import Router, run_experts


def _norm(size: int, config: Gemma4ModelConfig) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps)  # x / rms(x) * w: Gemma 4 stores w itself


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return per_row(lambda t: F.gelu(t, approximate="tanh"), x)


def proportional_rotary(head_dim: int, theta: float, fraction: float, factor: float) -> RotaryEmbedding:
    """transformers' "proportional" RoPE: a head_dim-wide rotation whose first int(fraction * head_dim // 2)
    frequencies are 1 / theta^(2i / head_dim) (the exponent over the whole head) and the rest 0 (cos 1, sin 0:
    those channels pass as they are), all divided by `factor`; the same fp32 steps, so the same bits."""
    rotary = RotaryEmbedding(head_dim, theta)
    angles = int(fraction * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = torch.cat((1.0 / (theta**exponents), torch.zeros(head_dim // 2 - angles, device="cpu")))
    rotary.inv_freq = inv_freq / factor
    return rotary


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads, self.head_dim = config.kv_shape_of(layer_index)
        self.sliding_window = config.window_for_layer(layer_index)
        self.stores_kv = config.kv_source_of(layer_index) == layer_index
        self.keys_from_values = config.k_eq_v_of(layer_index)
        self.rotary = rotary  # what keys derived from values rotate with, at their own positions
        hidden, q_size = config.hidden_size, config.num_heads * self.head_dim
        if not self.stores_kv:  # reads its source layer's K/V: a query projection alone
            self.q_proj = Linear(hidden, q_size)
        elif self.keys_from_values:  # one K/V projection, beside the query's
            self.qk_proj = MergedLinear(hidden, [q_size, self.num_kv_heads * self.head_dim])
        else:
            self.qkv_proj = QKVLinear(hidden, self.head_dim, self.num_heads, self.num_kv_heads)
        self.o_proj = Linear(q_size, hidden)
        self.q_norm = _norm(self.head_dim, config)
        if self.stores_kv:
            self.k_norm = _norm(self.head_dim, config)
            self.register_buffer("unit", torch.ones(self.head_dim, device="cpu"), persistent=False)  # V's norm
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext,
                layer: int) -> torch.Tensor:
        n, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if not self.stores_kv:
            q, k, v = self.q_proj(x), None, None
        elif self.keys_from_values:
            q, k = self.qk_proj(x).split([heads * dim, kv_heads * dim], dim=-1)
            v = None
        else:
            q, k, v = self.qkv_proj(x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = self.q_norm(q.reshape(n, heads, dim))  # a new contiguous tensor
        ops.rope_(q.view(n, heads * dim), cos, sin, heads, dim)
        if not self.stores_kv:
            return self.o_proj(kv.attend(layer, q, None, None, 1.0))
        if self.keys_from_values:
            values = self._norm_values(k.reshape(n, kv_heads, dim))
            return self.o_proj(kv.attend(layer, q, None, values, 1.0, keys_from_values=self.keys_of))
        k = self.k_norm(k.reshape(n, kv_heads, dim))
        ops.rope_(k.view(n, kv_heads * dim), cos, sin, kv_heads, dim)
        return self.o_proj(kv.attend(layer, q, k, self._norm_values(v.reshape(n, kv_heads, dim)), 1.0))

    def _norm_values(self, v: torch.Tensor) -> torch.Tensor:
        """V / rms(V) over each head (transformers' v_norm: no weight)."""
        return ops.rms_norm(v.reshape(-1, self.head_dim), self.unit, self.eps).view(v.shape)

    def keys_of(self, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A K = V layer's keys `[T, KVH, D]` from its stored values at `positions`: rope(v * k_norm.weight)."""
        cos, sin = self.rotary(positions)
        return ops.apply_rope(values * self.k_norm.weight, cos, sin)


class Gemma4Router(nn.Module):
    """x -> (weights `[N, k]`, experts `[N, k]`): softmax(proj(x / rms(x) * scale / sqrt(hidden))), its top k
    renormalised to sum to 1, each times its expert's `per_expert_scale`."""

    def __init__(self, config: Gemma4ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.eps = config.rms_norm_eps
        self.root = config.hidden_size**-0.5
        self.proj = Router(config.hidden_size, config.num_experts)
        self.scale = new_parameter(config.hidden_size)
        self.per_expert_scale = new_parameter(config.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = ops.rms_norm(x, self.scale, self.eps) * self.root
        probs = torch.softmax(self.proj(scaled).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = _norm(hidden, config)
        self.post_attention_layernorm = _norm(hidden, config)
        self.pre_feedforward_layernorm = _norm(hidden, config)
        self.post_feedforward_layernorm = _norm(hidden, config)
        self.self_attn = Gemma4Attention(config, layer_index, rotary)
        self.mlp = GatedMLP(hidden, config.mlp_width(layer_index), activation=ops.GELU_TANH)
        self.layer_scalar = new_parameter(1)
        self.has_experts = bool(config.num_experts)
        if self.has_experts:
            self.router = Gemma4Router(config)
            self.experts = nn.ModuleList(GatedMLP(hidden, config.moe_intermediate_size, activation=ops.GELU_TANH)
                                         for _ in range(config.num_experts))
            self.post_feedforward_layernorm_1 = _norm(hidden, config)
            self.pre_feedforward_layernorm_2 = _norm(hidden, config)
            self.post_feedforward_layernorm_2 = _norm(hidden, config)
        self.has_per_layer_input = config.per_layer_input_size > 0
        if self.has_per_layer_input:
            self.per_layer_input_gate = Linear(hidden, config.per_layer_input_size)
            self.per_layer_projection = Linear(config.per_layer_input_size, hidden)
            self.post_per_layer_input_norm = _norm(hidden, config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionContext, layer: int,
                per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv, layer)
        x = x + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(x))
        if self.has_experts:  # the experts read the same residual as the dense MLP, through their own norm
            weights, chosen = self.router(x)
            routed = run_experts(self.experts, self.pre_feedforward_layernorm_2(x), weights, chosen)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(out)
        if self.has_per_layer_input:
            gated = _gelu_tanh(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4's decoder: CausalLM's scaffolding, with a forward of its own that hands each layer its
    per-layer input."""

    stacked_params = CausalLM.stacked_params + (("qk_proj", "q_proj", 0), ("qk_proj", "k_proj", 1))

    def __init__(self, config: Gemma4ModelConfig) -> None:
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5  # a Python float: rounds as transformers' fp32 scale does
        full_dim = next((config.kv_shape_of(i)[1] for i, window in enumerate(config.layer_windows or ())
                         if window is None), config.head_dim)
        # Full layers: proportional RoPE over their own head_dim; sliding ones: plain RoPE, their own base.
        self.rotary_emb = proportional_rotary(full_dim, config.rope_theta, config.full_rope_fraction,
                                              config.full_rope_factor)
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, config.rope_local_theta or 10_000.0)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, self.rotary_for_layer(i))
                                    for i in range(config.num_layers))
        self.norm = _norm(config.hidden_size, config)
        self.build_head()
        size = config.per_layer_input_size
        if size:
            self.embed_tokens_per_layer = VocabEmbedding(config.per_layer_vocab_size, config.num_layers * size)
            self.per_layer_model_projection = Linear(config.hidden_size, config.num_layers * size)
            self.per_layer_projection_norm = _norm(size, config)

    def rotary_for_layer(self, index: int) -> RotaryEmbedding:
        return self.local_rotary_emb if self.config.window_for_layer(index) is not None else self.rotary_emb

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tables = {id(rotary): rotary(positions) for rotary in (self.rotary_emb, self.local_rotary_emb)}
        return [tables[id(self.rotary_for_layer(index))] for index in range(len(self.layers))]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """Every layer's input `[N, layers, size]`: (norm(proj(embedded) / sqrt(hidden)) + the tokens' scaled
        per-layer embedding) / sqrt(2); None without PLE."""
        size = self.config.per_layer_input_size
        if not size:
            return None
        shape = (input_ids.shape[0], self.config.num_layers, size)
        tokens = self.embed_tokens_per_layer(input_ids).view(shape) * size**0.5
        projected = self.per_layer_model_projection(embedded) * self.config.hidden_size**-0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + tokens) * 2.0**-0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: AttentionContext | None = None,
                logits_indices: torch.Tensor | None = None, states: StateContext | None = None) -> torch.Tensor:
        """input_ids/positions `[N]` -> logits `[N, vocab]` (or only the rows in `logits_indices`)."""
        if states is not None:
            raise ValueError("this model keeps no recurrent state: its forward takes no state context")
        if kv is None:
            kv = ContiguousContext(positions, self.layer_windows, self.config.kv_source_layers)
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x)
        for index, (layer, (cos, sin)) in enumerate(zip(self.layers, self.rope_tables(positions))):
            x = layer(x, cos, sin, kv, index, None if per_layer is None else per_layer[:, index])
        if logits_indices is not None:
            x = x[logits_indices]
        return self.compute_logits(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def shift_key_positions(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """As CausalLM's; a K = V layer's cache holds values, which carry no rotation: they stay as they are
        (its keys are derived at their new positions), and a layer reading another's cache holds nothing."""
        if self.config.k_eq_v_of(layer) or self.config.kv_source_of(layer) != layer:
            return keys
        return super().shift_key_positions(layer, keys, delta)

    def extra_checkpoint_tensors(self) -> dict[str, Callable[[torch.Tensor], None]]:
        # A GGUF file's `rope_freqs`: llama.cpp's form of the full layers' proportional RoPE (gemma4_gguf.py).
        return {"rope_freqs": self.rotary_emb.load_freq_divisors}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(text_weights(weights, self.config))


_NOT_RUN = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_UNUSED_IN_SHARED = ("k_proj", "v_proj", "k_norm", "v_norm")


def text_weights(weights: Iterable[tuple[str, torch.Tensor]],
                 config: Gemma4ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under the names the model loads: a Gemma4ForConditionalGeneration's
    `model.language_model.*` as `model.*` (its vision and audio towers are not run); each layer's stacked
    experts (`experts.gate_up_proj` `[E, 2I, hidden]`, `experts.down_proj` `[E, hidden, I]`) one per expert;
    a KV-sharing layer's K/V projections and norms, which some checkpoints carry, dropped (never run)."""
    ignored = _ignored_names(config)
    for name, tensor in weights:
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith(_NOT_RUN) or ignored(name):
            continue
        if ".experts." in name and name.endswith(".gate_up_proj.weight"):  # one expert's, from a GGUF file
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
            continue
        prefix, _, leaf = name.rpartition(".experts.")
        if prefix and leaf in ("gate_up_proj", "down_proj"):
            for e, expert in enumerate(tensor):
                if leaf == "gate_up_proj":
                    gate, up = expert.chunk(2, dim=0)
                    yield f"{prefix}.experts.{e}.gate_proj.weight", gate
                    yield f"{prefix}.experts.{e}.up_proj.weight", up
                else:
                    yield f"{prefix}.experts.{e}.down_proj.weight", expert
            continue
        yield name, tensor


def _ignored_names(config: Gemma4ModelConfig) -> Callable[[str], bool]:
    shared = {f"model.layers.{i}.self_attn.{part}." for i in range(config.num_layers)
              if config.kv_source_of(i) != i for part in _UNUSED_IN_SHARED}
    return lambda name: name.rpartition(".")[0] + "." in shared


FAMILY = ModelFamily(
    Gemma4ForCausalLM, read_hf_config, read_gguf_config, GGUF_LAYER_TENSORS,
    gguf_global_tensors=GGUF_GLOBAL_TENSORS, gguf_tensor_fix=undo_gguf_conversion, gguf_tensor_config=tensor_config)
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Gemma4ForCausalLM", HF, FAMILY),
    Architecture(CONDITIONAL, HF, FAMILY),  # the language model alone: no images or audio
    Architecture("gemma4", GGUF, FAMILY),  # NEOX RoPE: stored unpermuted; norms stored as w (no shift)
)
