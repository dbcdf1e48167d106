"""What a request's outputs are: timing metrics, logprobs, the prefix-cache report, and the two output types.

The engine emits a `RequestDelta` per request per step: only what that step
added (vLLM's RequestOutputKind.DELTA). `RequestOutputAssembler` turns a
request's deltas into its final, cumulative `RequestOutput` (vLLM's
FINAL_ONLY view), the one the offline API returns and non-streaming responses
are built from. See RequestDelta for why these are two types. Deciding what a
step's tokens add (stop conditions, text) is the output processor's job
(engine/output/processor.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field



@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock milestones of one request (time.perf_counter seconds)."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Speculative decoding: draft tokens verified for this request, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def draft_acceptance(self) -> float | None:
        """Fraction of its draft tokens the model accepted (None: nothing was drafted)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def record_token(self) -> None:
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.num_output_tokens += 1

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, seconds."""
        if self.num_output_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model, with the top alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    """One generated sequence of a final RequestOutput (vLLM's name): everything it generated."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for


@dataclass
class PrefixCacheReport:
    """How a request's prompt fared against the prefix cache, and why it missed where it did."""

    num_prompt_tokens: int
    num_cached_tokens: int
    reason: str
    divergence_position: int | None = None  # first prompt token that differs from the closest cached prompt
    prompt_snippet: str = ""  # text around the divergence: this prompt ...
    cached_snippet: str = ""  # ... and the cached one
    # The snippets' parts, for a display that highlights them: the text both share just before the
    # divergence, then how this prompt goes on and how the cached one does (bracketed in the snippets).
    common_text: str = ""
    prompt_continuation: str = ""
    cached_continuation: str = ""
    num_tier_cached_tokens: int = 0  # of num_cached_tokens, those loaded from a lower tier (disk)

    @property
    def sources(self) -> str:
        """Where the cached tokens came from, e.g. "256 from the pool, 768 from disk" ("" if none came from disk)."""
        if not self.num_tier_cached_tokens:
            return ""
        pool = self.num_cached_tokens - self.num_tier_cached_tokens
        return f"{pool} from the pool, {self.num_tier_cached_tokens} from disk"

    def describe(self) -> str:
        sources = f" ({self.sources})" if self.sources else ""
        lines = [f"prefix cache: {self.num_cached_tokens} of {self.num_prompt_tokens} prompt tokens cached{sources}; "
                 f"{self.reason}"]
        if self.divergence_position is not None:
            lines.append(f"  this prompt: {self.prompt_snippet!r}")
            lines.append(f"  cached:      {self.cached_snippet!r}")
        return "\n".join(lines)


@dataclass
class RequestOutput:
    """A request's final output (vLLM's name), cumulative: what `LLM.generate` returns. Built by
    RequestOutputAssembler from the engine's deltas, never by the engine itself."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_dropped_tokens: int = 0  # prompt tokens KV compression dropped from the cache (issue 43)
    kv_cache_bytes: int = 0  # KV memory the request held when it finished
    prefix_cache: PrefixCacheReport | None = None  # once admitted
    # With prompt_logprobs: None for the first prompt token, then one per token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set when this request failed on its own (finish_reason "error"): what went wrong. Other
    # requests of the same step are unaffected.
    error: str | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one engine step added to one request: the engine's only output type.

    The `new_*` fields hold this step's additions only (one token per decode
    step), so an output costs O(1) however long the generation; the engine
    keeps no copy of what it handed out. They are a separate type from the
    cumulative RequestOutput, not the same fields read two ways, so that code
    can never take a delta for a whole text (or count a whole text twice):
    `text`/`token_ids`/`logprobs` exist only on finals. Streaming sends deltas
    as they come; whoever needs the whole result feeds every delta of the
    request, in order, to a RequestOutputAssembler.

    Prompt logprobs are entries not handed out before, like the rest. They are
    complete once the first token is sampled and no delta comes before that
    one, so in practice they all ride on the request's first delta (partial
    only if the request was aborted or failed before its first token). The
    first delta is where a stream wants them (an echoed prompt opens the
    stream), and the assembler keeps them for the final.

    Scalars are as of this step; `prompt_token_ids` and `metrics` are the
    request's own objects (shared, not copied).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # accepted this step: one or more, or none (a final delta of an abort or error)
    new_text: str  # text that became safe to show this step (a possible stop string is held back)
    finish_reason: str | None
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_dropped_tokens: int = 0  # prompt tokens KV compression dropped from the cache so far
    kv_cache_bytes: int = 0  # KV memory the request holds now (when finished: held when it finished)
    prefix_cache: PrefixCacheReport | None = None  # once admitted
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    new_prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for; see above
    error: str | None = None  # set on the final delta of a request that failed on its own


@dataclass(slots=True)
class _Accumulated:
    """One request's deltas so far. Text is kept as pieces, joined once at the end."""

    token_ids: list[int] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class RequestOutputAssembler:
    """Turns requests' streams of RequestDeltas into their final RequestOutputs.

    Feed it every delta of a request, in order (deltas of many requests may
    interleave); `add` returns the request's final output with the delta that
    finishes it, else None. Each `add` costs what the delta holds; the final
    joins the text once, so a request costs O(its length) in all.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _Accumulated] = {}

    def add(self, delta: RequestDelta) -> RequestOutput | None:
        acc = self._requests.get(delta.request_id)
        if acc is None:
            acc = self._requests[delta.request_id] = _Accumulated(
                logprobs=None if delta.new_logprobs is None else [],
                prompt_logprobs=None if delta.new_prompt_logprobs is None else [])
        acc.token_ids.extend(delta.new_token_ids)
        if delta.new_text:
            acc.text_pieces.append(delta.new_text)
        if delta.new_logprobs:
            acc.logprobs.extend(delta.new_logprobs)
        if delta.new_prompt_logprobs:
            acc.prompt_logprobs.extend(delta.new_prompt_logprobs)
        if not delta.finished:
            return None
        del self._requests[delta.request_id]
        completion = CompletionOutput(0, "".join(acc.text_pieces), acc.token_ids, delta.finish_reason, acc.logprobs)
        return RequestOutput(
            delta.request_id, delta.prompt, delta.prompt_token_ids, [completion], True, delta.metrics,
            num_cached_tokens=delta.num_cached_tokens, num_dropped_tokens=delta.num_dropped_tokens,
            kv_cache_bytes=delta.kv_cache_bytes,
            prefix_cache=delta.prefix_cache, prompt_logprobs=acc.prompt_logprobs, error=delta.error,
        )

    @classmethod
    def assemble(cls, deltas: Iterable[RequestDelta]) -> RequestOutput:
        """One request's whole stream of deltas -> its final output."""
        assembler = cls()
        final = None
        for delta in deltas:
            final = assembler.add(delta)
        if final is None:
            raise ValueError("the deltas end before the request finished")
        return final
