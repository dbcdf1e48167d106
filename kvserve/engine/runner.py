"""Scheduler output -> model inputs -> logits -> sampled tokens. No policy here.

All scheduled requests (decodes and prefill chunks of different lengths) run
in ONE model forward per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.engine.output import TokenLogprob
from kvserve.engine.sampling import SamplingParams, make_generator, sample
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kv.attention import AttentionBackend, SequenceSlice
from kvserve.kv.context_shift import ShiftPlan, TokenMoves
from kvserve.kv.storage import PagedKVCache
from kvserve.model.llama import LlamaForCausalLM


@dataclass
class _SamplingState:
    params: SamplingParams
    generator: torch.Generator
    seen: torch.Tensor | None  # prompt + output tokens, for the repetition penalty
    output_counts: torch.Tensor | None  # occurrences per token in the output, for presence/frequency penalties
    prompt_token_ids: list[int] | None  # kept only when prompt logprobs are asked for

    @property
    def plain_greedy(self) -> bool:
        return self.params.greedy and self.seen is None and self.output_counts is None


@dataclass
class StepResult:
    """What one step produced: sampled tokens and, where asked for, log-probabilities."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request id -> (first prompt position covered, logprobs of prompt tokens from that position on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Requests whose own sampling or post-processing raised: they get no token; the others are unaffected.
    failures: dict[str, Exception] = field(default_factory=dict)

    def merge(self, other: "StepResult") -> None:
        self.tokens.update(other.tokens)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.failures.update(other.failures)


@dataclass
class _StepInputs:
    """One forward's rows, in the attention backend's batch order."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)  # one arange per request
    slices: list[SequenceSlice] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits sample a token
    sample_ids: list[str] = field(default_factory=list)  # their requests
    # (request, first prompt position, first row, rows) of the rows that score prompt tokens
    prompt_rows: list[tuple[str, int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, attention: AttentionBackend) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention  # the backend that allocated kv_cache
        layout = kv_cache.spec.layout
        cache_windows = tuple(layout.groups[group].window for group in layout.layer_group)
        if tuple(model.layer_windows) != cache_windows:
            raise ValueError(f"the KV cache was laid out for layer windows {cache_windows}, "
                             f"the model has {tuple(model.layer_windows)}")
        self._states: dict[str, _SamplingState] = {}

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        vocab = self.model.config.vocab_size
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(prompt_token_ids)] = True
        counts = torch.zeros(vocab) if params.penalizes_output else None
        prompt = list(prompt_token_ids) if params.prompt_logprobs is not None else None
        self._states[request_id] = _SamplingState(params, make_generator(params.seed), seen, counts, prompt)

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step; samples a token for every request that reached its last token."""
        for _, plan in out.shifts:  # before the forward writes into any block a shift freed
            self.apply_shift(plan)
        out.shifts = []  # applied once, even if the step is run again request by request
        inputs = self._prepare_inputs(out)
        logits = self._forward(inputs, out)
        sampled = logits[: len(inputs.sample_rows)]
        result = StepResult()
        self._sample(result, inputs.sample_ids, sampled)
        self._logprobs(result, inputs.sample_ids, sampled)
        self._prompt_logprobs(result, inputs.prompt_rows, logits[len(inputs.sample_rows):])
        for request_id in result.failures:
            result.tokens.pop(request_id, None)
            result.logprobs.pop(request_id, None)
            result.prompt_logprobs.pop(request_id, None)
        return result

    def apply_shift(self, plan: ShiftPlan) -> None:
        """Move a context shift's K/V: kept rows copied as they are, the rest moved `drop` positions earlier
        with their keys re-rotated by the model (quantized caches decode, rotate and re-encode)."""
        self._move_tokens(plan.copied, 0)
        self._move_tokens(plan.moved, -plan.drop)

    def _move_tokens(self, moves: TokenMoves, delta: int) -> None:
        if not moves.src_blocks:
            return
        cache, backend = self.kv_cache, self.attention
        # A fresh block must be zeroed before rows land in it, not after (the forward zeroes lazily).
        cache.initialize_blocks_through(max(moves.dst_blocks))
        src = backend.token_slots(cache, torch.tensor(moves.src_blocks), torch.tensor(moves.src_rows))
        dst = backend.token_slots(cache, torch.tensor(moves.dst_blocks), torch.tensor(moves.dst_rows))
        for layer in range(cache.spec.num_layers):
            k, v = cache.read_rows(layer, src)  # every source row is read before any is written
            if delta:
                k = self.model.shift_key_positions(layer, k, delta)
            cache.write(layer, dst, k, v)

    def _prepare_inputs(self, out: SchedulerOutput) -> _StepInputs:
        """Flatten the scheduled requests, in the attention backend's batch order, into one forward's rows."""
        inputs = _StepInputs()
        order = self.attention.batch_order([len(item.token_ids) for item in out.scheduled])
        for item in (out.scheduled[i] for i in order):
            count = len(item.token_ids)
            first_row = len(inputs.input_ids)
            inputs.input_ids.extend(item.token_ids)
            inputs.positions.append(torch.arange(item.num_computed_tokens, item.num_computed_tokens + count))
            inputs.slices.append(SequenceSlice(item.block_tables, item.num_computed_tokens, count))
            if item.sample:
                inputs.sample_rows.append(len(inputs.input_ids) - 1)
                inputs.sample_ids.append(item.request_id)
            prompt = self._states[item.request_id].prompt_token_ids
            if prompt is not None:
                # Position p's logits score prompt token p + 1.
                end = min(item.num_computed_tokens + count, len(prompt) - 1)
                if end > item.num_computed_tokens:
                    inputs.prompt_rows.append((item.request_id, item.num_computed_tokens, first_row,
                                               end - item.num_computed_tokens))
        return inputs

    def _forward(self, inputs: _StepInputs, out: SchedulerOutput) -> torch.Tensor:
        """One model forward; logits of the sampled rows, then of the prompt-logprob rows."""
        context = self.attention.build_context(self.kv_cache, inputs.slices)
        self.kv_cache.initialize_blocks_through(max(max(table) for item in out.scheduled
                                                    for table in item.block_tables))
        logits_rows = torch.cat([torch.tensor(inputs.sample_rows, dtype=torch.long)]
                                + [torch.arange(row, row + count) for _, _, row, count in inputs.prompt_rows])
        return self.model(torch.tensor(inputs.input_ids), torch.cat(inputs.positions), context, logits_rows)

    def _prompt_logprobs(self, result: StepResult, prompt_rows: list[tuple[str, int, int, int]],
                         logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this step's rows score; a request that raises fails alone."""
        offset = 0
        for request_id, first, _, count in prompt_rows:
            state = self._states[request_id]
            targets = state.prompt_token_ids[first + 1 : first + 1 + count]
            try:
                result.prompt_logprobs[request_id] = (first + 1, token_logprobs(
                    logits[offset : offset + count], targets, state.params.prompt_logprobs))
            except Exception as exc:
                result.failures[request_id] = exc
            offset += count

    def _sample(self, result: StepResult, request_ids: list[str], logits: torch.Tensor) -> None:
        """Sample each request's token into `result`; a request whose sampling raises fails alone."""
        states = [self._states[r] for r in request_ids]
        # Plain greedy rows are one batched argmax; the rest go through the sampler.
        plain = [i for i, s in enumerate(states) if s.plain_greedy]
        tokens = result.tokens
        if plain:
            # Every row plain (the common case): no copy of the rows' logits first.
            best = (logits if len(plain) == len(states) else logits[plain]).argmax(dim=-1).tolist()
            tokens.update((request_ids[i], t) for i, t in zip(plain, best))
        for i, state in enumerate(states):
            request_id = request_ids[i]
            try:
                if request_id not in tokens:
                    tokens[request_id] = sample(logits[i], state.params, state.generator, state.seen,
                                                state.output_counts)
                if state.seen is not None:
                    state.seen[tokens[request_id]] = True
                if state.output_counts is not None:
                    state.output_counts[tokens[request_id]] += 1
            except Exception as exc:
                result.failures[request_id] = exc

    def _logprobs(self, result: StepResult, request_ids: list[str], logits: torch.Tensor) -> None:
        wanted = [i for i, r in enumerate(request_ids)
                  if self._states[r].params.logprobs is not None and r in result.tokens]
        for i in wanted:
            request_id = request_ids[i]
            k = self._states[request_id].params.logprobs
            try:
                result.logprobs[request_id] = token_logprobs(logits[i : i + 1], [result.tokens[request_id]], k)[0]
            except Exception as exc:
                result.failures[request_id] = exc


def token_logprobs(logits: torch.Tensor, targets: list[int], top_k: int) -> list[TokenLogprob]:
    """Log-probabilities of `targets` (one per row of `logits`) plus each row's `top_k` alternatives."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].tolist()
    if top_k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen)]
    values, indices = logprobs.topk(top_k, dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(ids, vals)))
        for t, lp, ids, vals in zip(targets, chosen, indices.tolist(), values.tolist())
    ]
