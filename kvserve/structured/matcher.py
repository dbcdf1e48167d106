"""One request's grammar state: the allowed-token bitmask, accepted tokens in, forced tokens out.

In trigger mode the output is free text (no mask) until its bytes contain the trigger; bytes a token
carries past the trigger are the constrained part's first bytes and go through the grammar (a token that
ends the trigger and starts something the grammar refuses fails the request: GrammarStateError). With
`after` (a reasoning model's end of thinking) the output is free until it contains that text first, so nothing in
the thinking is constrained, nor starts the grammar.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import llguidance
import torch

from kvserve.errors import KVServeError
from kvserve.structured.mask import bitmask_words  # noqa: F401 (the engine's name for it is here)
from kvserve.structured.probe import short_error

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # (the compiler builds excluded texts, whose matcher shares this module's names)
    from kvserve.structured.compiler import CompiledGrammar


class GrammarStateError(KVServeError):
    """A token reached a grammar that refuses it (a bug or a trigger token the grammar cannot continue)."""


class GrammarMatcher:
    """A request's matcher. `force` False turns forced tokens off (benchmarks compare both)."""

    def __init__(self, compiled: CompiledGrammar, vocabulary: llguidance.LLTokenizer, trigger: str | None = None,
                 force: bool = True, after: str | None = None) -> None:
        self._state = compiled.new_state()
        self._first_mask = compiled.first_mask  # the initial state's, computed once per grammar
        self._vocabulary = vocabulary
        # What free text must contain before the grammar starts, in order: `after` (a reasoning model's end of
        # thinking), then the trigger.
        self._awaited = [marker.encode() for marker in (after, trigger) if marker is not None]
        self._tail = b""  # the free text's last bytes, where an awaited text may be starting
        self.force = force
        self.num_consumed = 0  # tokens consumed by the grammar (after any trigger)

    @property
    def constrained(self) -> bool:
        """Whether the grammar constrains the next token (False while a trigger is awaited)."""
        return not self._awaited

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return self.constrained and self._state.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output may end here (the grammar is complete, though it may allow more)."""
        return self.constrained and self._state.is_accepting()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32, CPU, contiguous, bitmask_words(vocab) words)."""
        if row.dtype != torch.int32 or not row.is_contiguous() or row.device.type != "cpu":
            raise ValueError("the bitmask row must be a contiguous int32 CPU tensor")
        if self._first_mask is not None and self.num_consumed == 0 and row.shape == self._first_mask.shape:
            row.copy_(self._first_mask)
            return
        self._state.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self._check()

    def consume(self, token_ids: list[int]) -> None:
        """Advance over accepted tokens (free text first, in trigger mode)."""
        for index, token in enumerate(token_ids):
            if not self.constrained:
                self._watch_trigger(token)
                continue
            if not self._state.consume_token(token):
                self._check()
                raise GrammarStateError(f"the grammar refused token {token} at output token {index}")
            self.num_consumed += 1

    def take_forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows alone next (llguidance's fast-forward tokens), at most `limit`,
        consumed: the caller must append them to the output."""
        if not self.force or limit <= 0 or not self.constrained or self._state.is_stopped():
            return []
        forced = self._state.compute_ff_tokens()[:limit]
        self.consume(forced)
        return forced

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` grammar-consumed tokens (not past the trigger)."""
        if num_tokens > self.num_consumed or not self._state.rollback(num_tokens):
            raise GrammarStateError(f"cannot roll back {num_tokens} of {self.num_consumed} tokens")
        self.num_consumed -= num_tokens

    def _watch_trigger(self, token: int) -> None:
        self._watch(self._vocabulary.decode_bytes([token]))

    def _watch(self, data: bytes) -> None:
        text, marker = self._tail + data, self._awaited[0]
        found = text.find(marker)
        if found < 0:
            self._tail = text[-(len(marker) - 1):] if len(marker) > 1 else b""
            return
        rest = text[found + len(marker):]
        self._awaited.pop(0)
        self._tail = b""
        if rest and self._awaited:
            self._watch(rest)
        elif rest:
            self.consume(self._vocabulary.tokenize_bytes(rest))

    def _check(self) -> None:
        if self._state.is_error():
            error = self._state.get_error()
            log.warning("a request's grammar failed: %s", error)  # with llguidance's state, for the log only
            raise GrammarStateError(f"grammar error: {short_error(error)}")
