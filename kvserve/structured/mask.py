"""Allowed-token bitmasks (llguidance's layout: bit t of int32 word t // 32) applied to logits rows."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of the allowed-token bitmask (one bit per token)."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool `[vocab_size]` tensor from one bitmask row: True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` (one row) with every token the bitmask forbids at -inf (a new tensor)."""
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))
