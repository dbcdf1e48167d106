"""The engine's side of structured outputs: each constrained request's grammar matcher, and after each step
the tokens its grammar forces next (kvserve/structured holds the grammar engine itself).

Forced tokens ride on the request (`Request.forced_token_ids`, already consumed by its matcher) and the
scheduler feeds them, all at once, with the request's last token: a mini-prefill whose K/V is kept, so a
JSON key the schema fixes costs one step instead of one step per token. They are bounded so that they and
the token sampled after them fit in max_tokens, the context and one step's token budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvserve.engine.request import Request
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.tokenizer import Tokenizer
from kvserve.structured.compiler import CompiledGrammar, GrammarCompiler
from kvserve.structured.excluded import ExcludedText, ExcludedTextMatcher
from kvserve.structured.matcher import GrammarMatcher, GrammarStateError
from kvserve.structured.vocabulary import build_grammar_vocabulary


@dataclass(frozen=True, slots=True)
class StructuredOutputStats:
    """Structured outputs and tool calls, engine side (monotonic counters, in the stats snapshot)."""

    grammar_compiles: int = 0  # specs compiled (cache misses), refused or not
    compile_cache_hits: int = 0  # specs found compiled (or refused) already
    compile_seconds: float = 0.0  # spent compiling and probing
    grammar_errors: int = 0  # specs refused, and requests whose grammar failed while they ran
    constrained_requests: int = 0  # requests added with a constraint
    forced_tokens: int = 0  # tokens a grammar fixed, appended without sampling


class ConstrainedRequests:
    """Compiles specs (built at the first one: the vocabulary walk costs ~0.4 s) and keeps the matchers."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._max_forced = max_num_batched_tokens - 1  # the last token + its forced ones fit in one step
        self._compiler: GrammarCompiler | None = None
        self._build_lock = threading.Lock()
        self._matchers: dict[str, GrammarMatcher] = {}
        self.force = True  # forced tokens as mini-prefills; benchmarks turn it off to compare
        self.num_requests = self.num_forced_tokens = self.num_failed = 0  # (the engine's thread only)

    @property
    def compiler(self) -> GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(build_grammar_vocabulary(self._tokenizer, self._vocab_size))
            return self._compiler

    def compile(self, params: SamplingParams) -> CompiledGrammar | ExcludedText | None:
        """The request's compiled grammar (cached), None when unconstrained; InvalidRequestError when it
        does not compile. Thread-safe: servers call it off the event loop before adding the request."""
        spec = params.structured_outputs
        return self.compiler.compile(spec) if spec is not None else None

    def new_matcher(self, params: SamplingParams) -> GrammarMatcher | ExcludedTextMatcher | None:
        compiled = self.compile(params)
        if compiled is None:
            return None
        if isinstance(compiled, ExcludedText):
            return ExcludedTextMatcher(compiled)
        spec = params.structured_outputs
        return GrammarMatcher(compiled, self.compiler.vocabulary, spec.trigger, force=self.force, after=spec.after,
                              after_open=spec.after_open)

    def add(self, request_id: str, matcher: GrammarMatcher | None) -> None:
        if matcher is not None:
            self._matchers[request_id] = matcher
            self.num_requests += 1

    def failed(self, error: Exception) -> None:
        """A request failed in a step (counted when its grammar was at fault)."""
        self.num_failed += isinstance(error, GrammarStateError)

    def snapshot(self) -> StructuredOutputStats:
        compiler = self._compiler  # (None until the first constrained request)
        if compiler is None:
            return StructuredOutputStats(constrained_requests=self.num_requests)
        return StructuredOutputStats(compiler.num_compiled + compiler.num_refused, compiler.num_cache_hits,
                                     compiler.compile_seconds,
                                     compiler.num_refused + self.num_failed, self.num_requests,
                                     self.num_forced_tokens)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def after_step(self, request: Request) -> str | None:
        """Once a step's accepted tokens are appended (and consumed by the matcher): "stop" when the grammar
        is complete, else None, with the tokens it forces next put on the request."""
        matcher = self._matchers.get(request.request_id) if self._matchers else None
        if matcher is None:
            return None
        if matcher.is_stopped:
            return "stop"
        limit = min(self._max_forced,
                    request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                    self._max_model_len - request.num_tokens - 1)
        try:
            request.forced_token_ids = matcher.take_forced(limit)
        except GrammarStateError:
            pass  # the matcher is in its error state: the next step's mask fails this request alone
        self.num_forced_tokens += len(request.forced_token_ids)
        return None


def with_forced(request: Request, count: int, remaining: int, budget: int) -> int:
    """A step's token count for a request with forced tokens pending: they ride on the step that reaches its
    last token, all of them; a step that reaches it without room for them stops one token short."""
    if not request.forced_token_ids or count < remaining:
        return count
    if remaining + len(request.forced_token_ids) <= budget:
        return count + len(request.forced_token_ids)
    return count - 1
