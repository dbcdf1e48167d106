"""Scheduler output -> model inputs -> logits -> sampled tokens. No policy here.

All scheduled requests (decodes and prefill chunks of different lengths) run
in ONE model forward per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.sampling import SamplingParams, make_generator, sample
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kv.attention import PagedKVContext, SequenceSlice, build_attention_metadata
from kvserve.kv.storage import PagedKVCache
from kvserve.model.llama import LlamaForCausalLM


@dataclass
class _SamplingState:
    params: SamplingParams
    generator: torch.Generator
    seen: torch.Tensor | None  # prompt + output tokens, for the repetition penalty


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self._states: dict[str, _SamplingState] = {}

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(self.model.config.vocab_size, dtype=torch.bool)
            seen[torch.tensor(prompt_token_ids)] = True
        self._states[request_id] = _SamplingState(params, make_generator(params.seed), seen)

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns the sampled token of every request that reached its last token."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for item in out.scheduled:
            count = len(item.token_ids)
            input_ids.extend(item.token_ids)
            positions.append(torch.arange(item.num_computed_tokens, item.num_computed_tokens + count))
            slices.append(SequenceSlice(item.block_ids, item.num_computed_tokens, count))
            if item.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(item.request_id)
        metadata = build_attention_metadata(slices, self.kv_cache.block_size, self.model.config.sliding_window)
        self.kv_cache.initialize_blocks_through(max(max(item.block_ids) for item in out.scheduled))
        logits = self.model(
            torch.tensor(input_ids), torch.cat(positions), PagedKVContext(self.kv_cache, metadata),
            torch.tensor(sample_rows, dtype=torch.long),
        )
        return self._sample(sample_ids, logits)

    def _sample(self, request_ids: list[str], logits: torch.Tensor) -> dict[str, int]:
        states = [self._states[r] for r in request_ids]
        # Plain greedy rows are one batched argmax; the rest go through the sampler.
        plain = [i for i, s in enumerate(states) if s.params.greedy and s.seen is None]
        tokens: dict[str, int] = {}
        if plain:
            best = logits[plain].argmax(dim=-1).tolist()
            tokens.update((request_ids[i], t) for i, t in zip(plain, best))
        for i, state in enumerate(states):
            if request_ids[i] not in tokens:
                tokens[request_ids[i]] = sample(logits[i], state.params, state.generator, state.seen)
            if state.seen is not None:
                state.seen[tokens[request_ids[i]]] = True
        return tokens
