"""Model-shape configuration shared by every layer of kvserve."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling` / `rope_parameters`.

    `rope_type` is "default", "linear" or "llama3"; the other fields are used
    only by the types that need them.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # Mistral-style sliding window: a query attends to the last `sliding_window`
    # positions (itself included). None means full attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"
