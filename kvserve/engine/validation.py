"""Whether the engine can take a request at all: its tokens, and whether it fits the context and the pool."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.manager import KVCacheManager


@dataclass(frozen=True)
class RequestLimits:
    """The fixed limits a request is checked against: safe to read from any thread while a step runs."""

    config: EngineConfig
    vocab_size: int
    max_model_len: int
    kv_manager: KVCacheManager  # only its fixed geometry is read (can_fit, peak_blocks, num_blocks)

    def validate(self, token_ids: list[int], params: SamplingParams, compression: ChunkPolicy | None = None) -> None:
        """Raise InvalidRequestError if the engine would refuse these (`compression`: the prompt's chunk geometry
        under KV compression, None: off)."""
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
        needed = self.peak_blocks(total, compression)
        if needed > self.kv_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{needed} KV blocks{' (compressed)' if compression is not None else ''} but the whole cache has "
                f"{self.kv_manager.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )

    def peak_blocks(self, num_tokens: int, compression: ChunkPolicy | None) -> int:
        """The most blocks a request of `num_tokens` holds at once; a compressing one's compressed chunks count
        their kept blocks (kv/compressed_chunks.py)."""
        kv = self.kv_manager
        if compression is not None:
            return kv.peak_blocks_compressed(compression, num_tokens, self.config.max_num_batched_tokens)
        return kv.peak_blocks(num_tokens, self.config.max_num_batched_tokens)
