"""Whether the engine can take a request at all: its tokens, and whether it fits the context and the pool."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.manager import KVCacheManager


@dataclass(frozen=True)
class RequestLimits:
    """The fixed limits a request is checked against: safe to read from any thread while a step runs."""

    config: EngineConfig
    vocab_size: int
    max_model_len: int
    kv_manager: KVCacheManager  # only its fixed geometry is read (can_fit, peak_blocks, num_blocks)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the engine would refuse these."""
        vocab = self.vocab_size
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if self.config.context_overflow == "shift":
            # Generation continues past the context by dropping old tokens: only the prompt must fit.
            if len(token_ids) > self.max_model_len:
                raise InvalidRequestError(f"the prompt ({len(token_ids)} tokens) exceeds the model's context of "
                                          f"{self.max_model_len} tokens (context shift applies to generation)")
            total = min(total, self.max_model_len)
        elif total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        chunk, kv = self.config.max_num_batched_tokens, self.kv_manager
        if not kv.can_fit(total, chunk):
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{kv.peak_blocks(total, chunk)} KV blocks but the whole cache has "
                f"{kv.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
