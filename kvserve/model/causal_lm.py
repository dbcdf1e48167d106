"""What every decoder family shares: checkpoint loading into fused projections, per-layer windows, the
parameter count. A family (kvserve.model.llama, kvserve.model.gemma3) builds its modules and its forward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model.weights import checkpoint_targets, parameter_count, stream_weights


class CausalLM(nn.Module):
    """Base of the model classes. Subclasses set `config`, `embed_tokens`, `layers` (each with
    `self_attn.sliding_window`), `norm` and `lm_head`, and define
    `forward(input_ids, positions, kv=None, logits_indices=None)`."""

    config: ModelConfig

    # Hugging Face's separate projections -> the shards of our fused ones.
    stacked_params = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def extra_checkpoint_tensors(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """Checkpoint tensors that are not parameters, by name -> what takes them (e.g. GGUF `rope_freqs`)."""
        return {}

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
        """Each layer's sliding window (None = full): what an attention context is built for."""
        return tuple(layer.self_attn.sliding_window for layer in self.layers)

    def num_parameters(self) -> int:
        """The model's parameter count, whatever format its linear layers hold (a tied head counts once)."""
        return parameter_count(self, self.lm_head if self.config.tie_word_embeddings else None)
