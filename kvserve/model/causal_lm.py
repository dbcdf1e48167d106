"""What every decoder family shares: the forward's scaffolding (embedding, the layer loop with each layer's
RoPE tables, the final norm, the logits rows), the context shift's key re-rotation, checkpoint loading
into fused projections, per-layer windows, the parameter count. A family (kvserve.model.llama,
kvserve.model.gemma3) builds its modules and says where it differs through the hooks below."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kernels import ops
from kvserve.kv.attention import AttentionContext, ContiguousContext
from kvserve.kv.state.context import ContiguousStateContext, StateContext
from kvserve.model.layers import Linear, RotaryEmbedding, VocabEmbedding
from kvserve.model.weights import checkpoint_targets, parameter_count, stream_weights


class CausalLM(nn.Module):
    """Decoder-only transformer.

    `forward(input_ids, positions, kv)` runs a step's N new tokens (of one or many requests) at
    `positions`; `kv`, the step's attention context (from the engine's attention backend), stores their
    K/V and attends over what each request has cached, each layer within its own window. With `kv=None`
    the tokens must be one whole sequence, attended over by the contiguous context (nothing stored).

    A family's `__init__` calls this one (config, embedding), then builds `layers` (each a module called
    as `layer(x, cos, sin, kv, layer_index)`, with `self_attn.sliding_window`), `norm`, `build_head()`
    and `rotary_emb`.

    A hybrid model (`config.layer_kinds`: Qwen3.5, LFM2) has recurrent layers too: its forward also gets
    `states`, the step's recurrent-state context (kv/state/context.py), and calls every layer as
    `layer(x, cos, sin, kv, layer_index, states)`. Only its attention layers have `self_attn`; the i-th of
    them is attention layer i of the KV cache (`config.attention_layers`), and it attends as that layer
    (`kv.attend(i, ...)`); the i-th recurrent layer is state layer i. Without a KV cache the state context
    is a contiguous one (one sequence from position 0, nothing kept).
    """

    # Hugging Face's separate projections -> the shards of our fused ones.
    stacked_params = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)

    def build_head(self) -> None:
        """The output projection; with tied embeddings it is the embedding's tensor (one checkpoint target,
        not two; a quantized head converts a copy)."""
        self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # --- where families differ -----------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's first value for `input_ids`: their rows of the embedding (one op; the
        module's call took ~40 us of a SmolLM2 decode step, its Python run with the weights just through
        the caches)."""
        return self.embed_tokens.weight.index_select(0, input_ids)

    def rotary_for_layer(self, index: int) -> RotaryEmbedding:
        """The rotary embedding layer `index` rotates its queries and keys with."""
        return self.rotary_emb

    def rope_tables(self, positions: torch.Tensor) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin at `positions` for each layer in turn (as `rotary_for_layer` says), each table computed
        once per step. One RoPE for every layer here: the same tables, without a per-layer lookup."""
        return itertools.repeat(self.rotary_emb(positions))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection of the rows logits are wanted for."""
        return self.lm_head(self.norm(hidden))

    def run_layers_at_once(self, x: torch.Tensor, positions: torch.Tensor, kv: AttentionContext) -> bool:
        """Every layer over x (in place) in one kernel call where the family and the step allow it, with the
        bits the layers' own forward gives (kvserve.model.decoder_stack); False: nothing ran, the layers
        run one by one."""
        return False

    def decoder_stack(self) -> object | None:
        """The stack `run_layers_at_once` runs the layers as, once built (None: this family has none)."""
        return None

    def extra_checkpoint_tensors(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint tensors that are not parameters, by name -> what takes them (e.g. GGUF `rope_freqs`)."""
        return {}

    # --- shared ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: AttentionContext | None = None,
        logits_indices: torch.Tensor | None = None,
        states: StateContext | None = None,
    ) -> torch.Tensor:
        """input_ids/positions `[N]` -> logits `[N, vocab]` (or only the rows in `logits_indices`)."""
        if kv is None:
            kv = ContiguousContext(positions, self.layer_windows, self.config.kv_source_layers)
        if states is not None and not self.has_recurrent_state:
            raise ValueError("this model keeps no recurrent state: its forward takes no state context")
        if states is None and self.has_recurrent_state:
            if not isinstance(kv, ContiguousContext):
                raise ValueError("a hybrid model's forward over a KV cache needs its recurrent-state context")
            states = ContiguousStateContext(input_ids.shape[0])  # one whole sequence, as its attention
        x = self.embed(input_ids)
        if states is not None or not self.run_layers_at_once(x, positions, kv):
            for index, (layer, (cos, sin)) in enumerate(zip(self.layers, self.rope_tables(positions))):
                x = layer(x, cos, sin, kv, index) if states is None else layer(x, cos, sin, kv, index, states)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.compute_logits(x)

    def shift_key_positions(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Cached keys `[T, KVH, D]` of `layer` (RoPE applied) as if computed `delta` positions later: RoPE is
        a rotation by position, so rotating by `delta` with the layer's own rotary embedding moves them (a
        context shift's re-rotation, as llama.cpp does). A layer without RoPE keeps them as they are."""
        layer = self.config.attention_layers[layer]  # the cache's attention layer -> the model's layer
        if self.config.rope_layers is not None and not self.config.rope_layers[layer]:
            return keys
        cos, sin = self.rotary_for_layer(layer).rotation(torch.tensor([delta], device=keys.device))
        return ops.apply_rope(keys, cos, sin)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream Hugging Face-named tensors into the parameters, each exactly once (see kvserve.model.weights)."""

        def ignore(name: str) -> bool:
            # Some tied checkpoints store a copy of lm_head; some exporters save
            # the rotary buffers, which are computed from the config.
            tied = self.config.tie_word_embeddings
            return (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

        stream_weights(weights, checkpoint_targets(self, self.stacked_params), ignore,
                       extra=self.extra_checkpoint_tensors())

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each attention layer's sliding window (None = full): what an attention context is built for."""
        return tuple(self.layers[layer].self_attn.sliding_window for layer in self.config.attention_layers)

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some layers keep a recurrent state per request (a hybrid model)."""
        return bool(self.config.recurrent_layers)

    def num_parameters(self) -> int:
        """The model's parameter count, whatever format its linear layers hold (a tied head counts once)."""
        return parameter_count(self, self.lm_head if self.config.tie_word_embeddings else None)
