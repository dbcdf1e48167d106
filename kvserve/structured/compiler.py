"""A StructuredOutputsParams -> a compiled llguidance grammar, bounded in time and cached by spec.

Compiling builds llguidance's lexer and parser tables for the model's vocabulary: well under a millisecond
for a small schema, more for a large tool manifest, unbounded in principle for a hostile one, so it runs on
a worker thread and gives up after `timeout_s` (the worker finishes on its own; llguidance's own fuel
limits bound it). An agent loop resends the same schema every turn: equal specs (`cache_key`) share one
compiled grammar, and each request gets a copy of its initial state.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from kvserve.errors import InvalidRequestError
from kvserve.structured.excluded import ExcludedText
from kvserve.structured.params import PARAM, StructuredOutputsParams
from kvserve.structured.probe import longest_first, probe, short_error

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 128
# JSON as json.dumps writes it, and no free whitespace between tokens: a small model given free whitespace
# can emit newlines until max_tokens, and a fixed layout lets the grammar force keys and punctuation.
# A schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a spec; InvalidRequestError when it cannot be built."""
    try:
        if spec.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_DEFAULTS)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))  # Lark as is; GBNF converted
    except Exception as error:  # llguidance reports bad input as ValueError / RuntimeError
        raise InvalidRequestError(f"structured_outputs.{spec.kind} does not compile: {error}", param=PARAM) from error


class CompileTimeout(InvalidRequestError):
    """A grammar that took longer than the compiler's limit to build."""


class CompiledGrammar:
    """One spec's grammar in its initial state; `new_state()` is a fresh llguidance matcher for a request.
    `first_mask` is the initial state's allowed tokens (computed once, when the grammar was probed)."""

    def __init__(self, initial: llguidance.LLMatcher, first_mask: torch.Tensor | None = None) -> None:
        self._initial = initial
        self.first_mask = first_mask
        self._lock = threading.Lock()  # copies may be taken from several threads; the original never moves

    def new_state(self) -> llguidance.LLMatcher:
        with self._lock:
            return self._initial.deep_copy()


class GrammarCompiler:
    """Compiles specs for one vocabulary; thread-safe (the server compiles on worker threads)."""

    def __init__(self, vocabulary: llguidance.LLTokenizer, timeout_s: float = DEFAULT_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.vocabulary = vocabulary
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        # A spec's grammar, or the error it gave (a hostile schema that takes seconds to fail fails once)
        self._cache: OrderedDict[str, CompiledGrammar | ExcludedText | InvalidRequestError] = OrderedDict()
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._order: np.ndarray | None = None  # token ids, longest first, for the probe (structured/probe.py)
        self.num_compiled = 0  # grammars compiled (cache misses that were not refused), for tests and stats
        self.num_cache_hits = 0  # specs found compiled (or refused) already
        self.num_refused = 0  # specs refused: did not compile, failed their probe, or timed out
        self.compile_seconds = 0.0  # spent compiling (and probing), successes and failures alike

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar | ExcludedText:
        """The spec's grammar (an excluded text's bans), from the cache or compiled now; InvalidRequestError
        if it does not compile or takes longer than `timeout_s`."""
        key = spec.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
        if cached is None:
            started = time.perf_counter()
            try:
                cached = self._compile(spec)
            except CompileTimeout:  # may pass on a quieter machine: not kept
                self._count(time.perf_counter() - started, refused=True)
                raise
            except InvalidRequestError as error:
                cached = error
            self._count(time.perf_counter() - started, refused=isinstance(cached, InvalidRequestError))
            with self._lock:
                self._cache[key] = cached
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, InvalidRequestError):
            raise InvalidRequestError(str(cached), param=cached.param)
        return cached

    def _count(self, seconds: float, refused: bool) -> None:
        with self._lock:
            self.num_compiled += not refused
            self.compile_seconds += seconds
            self.num_refused += refused

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar | ExcludedText:
        if spec.excluded_text is not None:  # no grammar: a token ban per state (~0.1 s once per vocabulary)
            return ExcludedText(self.vocabulary, spec.excluded_text)
        text = grammar_text(spec)
        future = self._workers.submit(llguidance.LLMatcher, self.vocabulary, text, log_level=0)
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise CompileTimeout(f"grammar compilation took longer than {self.timeout_s:g} s",
                                      param=PARAM) from None
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs.{spec.kind} does not compile: "
                                      f"{short_error(matcher.get_error())}", param=PARAM)
        if self._order is None:
            self._order = longest_first(self.vocabulary)
        first_mask, error = probe(matcher, self._order)  # what fails only once masks are computed
        if error is not None:
            raise InvalidRequestError(f"structured_outputs.{spec.kind} does not compile: {error}", param=PARAM)
        return CompiledGrammar(matcher, first_mask)
