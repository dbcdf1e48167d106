"""A step's logits rows -> the tokens each request accepts: sampling, draft verification, logprobs.

A request that reaches its last token gets one logits row per token it may
accept: one, or with forced/draft tokens the row of the last forced token and
one per draft after it. Forced tokens are accepted as they are; drafts are
verified against the target model: greedy keeps the longest prefix of drafts
that equal the argmax of the row before each, then the argmax after the last
kept one (so every step accepts at least one token); sampling and penalized
requests go through rejection sampling (engine/spec_decode/verify.py), which
leaves each token distributed exactly as without drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.engine.output.types import TokenLogprob
from kvserve.engine.sample.sampling import SamplingParams, greedy_tokens, make_generator, sample
from kvserve.engine.spec_decode.verify import verify_drafts
from kvserve.structured.mask import apply_bitmask
from kvserve.structured.matcher import GrammarMatcher, bitmask_words


@dataclass
class _SamplingState:
    params: SamplingParams
    generator: torch.Generator
    seen: torch.Tensor | None  # prompt + output tokens, for the repetition penalty
    output_counts: torch.Tensor | None  # occurrences per token in the output, for presence/frequency penalties
    prompt_token_ids: list[int] | None  # kept only when prompt logprobs are asked for
    matcher: GrammarMatcher | None = None  # structured outputs: the grammar masks each sampled token

    @property
    def plain_greedy(self) -> bool:
        return self.params.greedy and self.seen is None and self.output_counts is None and self.matcher is None


@dataclass
class StepResult:
    """What one step produced: the tokens each request accepted and, where asked for, log-probabilities."""

    tokens: dict[str, list[int]] = field(default_factory=dict)  # accepted, in order (at least one)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # one per accepted token
    # request id -> (first prompt position covered, logprobs of prompt tokens from that position on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Requests whose own sampling or post-processing raised: they get no token; the others are unaffected.
    failures: dict[str, Exception] = field(default_factory=dict)

    def merge(self, other: "StepResult") -> None:
        self.tokens.update(other.tokens)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.failures.update(other.failures)

    def drop_failed(self) -> None:
        for request_id in self.failures:
            self.tokens.pop(request_id, None)
            self.logprobs.pop(request_id, None)
            self.prompt_logprobs.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class AcceptRows:
    """One request's logits rows in a step: `first` (into the step's sampled rows) and one per draft more."""

    request_id: str
    first: int
    forced_token_ids: tuple[int, ...] = ()
    draft_token_ids: tuple[int, ...] = ()
    # Rows before `first` that score the forced tokens (each the row of the token before it): given only
    # when logprobs are asked for, so forced tokens get theirs too.
    num_forced_rows: int = 0


class TokenAcceptor:
    """Per-request sampling state (generator, penalty counts) and the step's accept rule."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[str, _SamplingState] = {}
        # One row, reused. Host memory on any device: llguidance writes it through a CPU pointer (the
        # masking moves it to the logits' device).
        self._bitmask = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32, device="cpu")

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    matcher: GrammarMatcher | None = None) -> None:
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seen[torch.tensor(prompt_token_ids, device=self.device)] = True
        counts = torch.zeros(self.vocab_size, device=self.device) if params.penalizes_output else None
        prompt = list(prompt_token_ids) if params.prompt_logprobs is not None else None
        self._states[request_id] = _SamplingState(params, make_generator(params.seed), seen, counts, prompt, matcher)

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def prompt_token_ids(self, request_id: str) -> list[int] | None:
        """The prompt, where its logprobs are asked for (else None)."""
        return self._states[request_id].prompt_token_ids

    def wants_logprobs(self, request_id: str) -> bool:
        return self._states[request_id].params.logprobs is not None

    def accept(self, result: StepResult, rows: list[AcceptRows], logits: torch.Tensor) -> None:
        """Each request's accepted tokens (and their logprobs) into `result`; one that raises fails alone."""
        tokens = result.tokens
        singles = [row for row in rows if not row.draft_token_ids]
        # Plain greedy rows without drafts are one batched argmax; the rest go one by one.
        plain = [row for row in singles if self._states[row.request_id].plain_greedy]
        if plain:
            # Every row plain (the common case): no copy of the rows' logits first.
            picked = logits if len(plain) == len(rows) == logits.shape[0] else logits[[row.first for row in plain]]
            for row, token in zip(plain, greedy_tokens(picked)):
                tokens[row.request_id] = [*row.forced_token_ids, token]
        for row in rows:
            state = self._states[row.request_id]
            try:
                if row.request_id not in tokens:
                    tokens[row.request_id] = [*row.forced_token_ids, *self._pick(row, state, logits)]
                self._count(state, tokens[row.request_id])
                if state.params.logprobs is not None:
                    result.logprobs[row.request_id] = self._logprobs(row, state, logits, tokens[row.request_id])
            except Exception as exc:
                result.failures[row.request_id] = exc

    def _pick(self, row: AcceptRows, state: _SamplingState, logits: torch.Tensor) -> list[int]:
        """The tokens after the forced ones: sampled, or drafts verified."""
        if state.matcher is not None:  # constrained: never drafted
            return [self._sample_constrained(logits[row.first], state)]
        if not row.draft_token_ids:
            return [sample(logits[row.first], state.params, state.generator, state.seen, state.output_counts)]
        if not state.plain_greedy:
            rows = logits[row.first : row.first + len(row.draft_token_ids) + 1]
            return verify_drafts(rows, row.draft_token_ids, state.params, state.generator, state.seen,
                                 state.output_counts)
        best = greedy_tokens(logits[row.first : row.first + len(row.draft_token_ids) + 1])
        kept = 0
        while kept < len(row.draft_token_ids) and row.draft_token_ids[kept] == best[kept]:
            kept += 1
        return [*row.draft_token_ids[:kept], best[kept]]

    def _sample_constrained(self, logits: torch.Tensor, state: _SamplingState) -> int:
        """A token the grammar allows (free text while a trigger is awaited), consumed by the matcher. The
        mask only changes what is sampled: logprobs are the raw model's."""
        matcher = state.matcher
        if matcher.constrained:
            matcher.fill_bitmask(self._bitmask)
            logits = apply_bitmask(logits, self._bitmask)
        token = sample(logits, state.params, state.generator, state.seen, state.output_counts)
        matcher.consume([token])
        return token

    @staticmethod
    def _count(state: _SamplingState, token_ids: list[int]) -> None:
        """Penalty state counts accepted tokens only."""
        for token in token_ids:
            if state.seen is not None:
                state.seen[token] = True
            if state.output_counts is not None:
                state.output_counts[token] += 1

    @staticmethod
    def _logprobs(row: AcceptRows, state: _SamplingState, logits: torch.Tensor,
                  accepted: list[int]) -> list[TokenLogprob]:
        """Logprobs of the accepted tokens, each from the row that predicted it (the forced ones from the
        rows before `first`)."""
        scored = accepted[len(row.forced_token_ids) - row.num_forced_rows:]
        first = row.first - row.num_forced_rows
        return token_logprobs(logits[first : first + len(scored)], scored, state.params.logprobs)

    def prompt_logprobs(self, result: StepResult, prompt_rows: list[tuple[str, int, int, int]],
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


def token_logprobs(logits: torch.Tensor, targets: list[int], top_k: int) -> list[TokenLogprob]:
    """Log-probabilities of `targets` (one per row of `logits`) plus each row's `top_k` alternatives."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None])[:, 0].tolist()
    if top_k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen)]
    values, indices = logprobs.topk(top_k, dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(ids, vals)))
        for t, lp, ids, vals in zip(targets, chosen, indices.tolist(), values.tolist())
    ]
