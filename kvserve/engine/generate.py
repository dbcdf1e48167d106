"""Generation for one request: prefill once, then decode token by token over the KV cache.

This is the foundation's loop (one sequence, contiguous cache). The batched
engine with a paged cache builds on the same pieces: the model forward, the
sampler and the OutputTracker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from kvserve.engine.output import OutputTracker, RequestMetrics
from kvserve.engine.sampling import SamplingParams, make_generator, sample
from kvserve.errors import InvalidRequestError
from kvserve.kv.cache import ContiguousKVCache
from kvserve.model.loader import LoadedModel

_LAST_ROW = torch.tensor([-1])


@dataclass
class GenerationDelta:
    """What one step added: new text (safe to show) and the new token id."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    kv_cache_bytes: int  # KV memory this request held (0 when recomputing)
    deltas: list[GenerationDelta] = field(default_factory=list, repr=False)


class Generator:
    """Runs single requests on a loaded model.

    With `use_kv_cache=False` every step recomputes the whole sequence (the
    baseline that shows what the cache buys); tokens are identical either way.
    """

    def __init__(self, loaded: LoadedModel, cache_dtype: str = "auto", use_kv_cache: bool = True) -> None:
        self.loaded = loaded
        self.cache_dtype = cache_dtype
        self.use_kv_cache = use_kv_cache

    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Text (optionally rendered as one user turn of a chat) or token ids -> token ids."""
        if isinstance(prompt, str):
            tokenizer = self.loaded.require_tokenizer()
            if chat:
                return tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return tokenizer.encode(prompt)
        return list(prompt)

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        config = self.loaded.config
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > config.max_position_embeddings:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {config.max_position_embeddings} tokens"
            )

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[GenerationDelta]:
        """One delta per generated token; the last has `finished=True`, and the
        iterator's return value (StopIteration.value) is the GenerationResult.

        Invalid requests raise here, before anything runs.
        """
        self._check_prompt(prompt_token_ids, params)
        tracker = OutputTracker(params, self.loaded.tokenizer)
        return self._run(prompt_token_ids, params, tracker)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> GenerationResult:
        params = params or SamplingParams()
        stream = self.stream(self.encode_prompt(prompt), params)
        deltas: list[GenerationDelta] = []
        while True:
            try:
                deltas.append(next(stream))
            except StopIteration as stop:
                result: GenerationResult = stop.value
                result.deltas = deltas
                return result

    def _run(self, prompt_token_ids: list[int], params: SamplingParams, tracker: OutputTracker):
        model = self.loaded.model
        metrics = RequestMetrics(num_prompt_tokens=len(prompt_token_ids))
        generator = make_generator(params.seed)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(self.loaded.config.vocab_size, dtype=torch.bool)
            seen[torch.tensor(prompt_token_ids)] = True
        cache = None
        if self.use_kv_cache:
            cache = ContiguousKVCache(self.loaded.config, self.cache_dtype, len(prompt_token_ids) + params.max_tokens)

        token_ids = list(prompt_token_ids)
        # Prefill: the whole prompt in one forward; logits only for its last token.
        logits = model(torch.tensor(token_ids), torch.arange(len(token_ids)), cache, _LAST_ROW)
        while True:
            token_id = sample(logits[-1], params, generator, seen)
            metrics.record_token()
            tracker.append(token_id)
            yield GenerationDelta(tracker.take_delta(), [token_id], tracker.finished, tracker.finish_reason)
            if tracker.finished:
                break
            token_ids.append(token_id)
            if seen is not None:
                seen[token_id] = True
            if cache is not None:
                # Decode: only the new token's K/V are computed; attention reads the rest.
                position = len(token_ids) - 1
                logits = model(torch.tensor([token_id]), torch.tensor([position]), cache)
            else:
                logits = model(torch.tensor(token_ids), torch.arange(len(token_ids)), None, _LAST_ROW)
        return GenerationResult(
            prompt_token_ids=list(prompt_token_ids),
            token_ids=tracker.token_ids,
            text=tracker.text,
            finish_reason=tracker.finish_reason or "length",
            metrics=metrics,
            kv_cache_bytes=cache.bytes_allocated if cache is not None else 0,
        )
