"""One request's grammar state: the allowed-token bitmask, accepted tokens in, forced tokens out.

In trigger mode the output is free text (no mask) until its bytes contain the trigger; bytes a token
carries past the trigger are the constrained part's first bytes and go through the grammar (a token that
ends the trigger and starts something the grammar refuses fails the request: GrammarStateError). With
`after` (a reasoning model's end of thinking) the output is free until it contains that text first, so nothing in
the thinking is constrained, nor starts the grammar; with `after_open` too, only an output that opens its thinking
is awaited to close it (decided at its first token: the opening's first token, or the grammar's).
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


def _bit(position: int) -> int:
    """Bit `position` of an int32 bitmask word, as a signed int32 value."""
    return (1 << position) - (1 << 32) if position == 31 else 1 << position

if TYPE_CHECKING:  # (the compiler builds excluded texts, whose matcher shares this module's names)
    from kvserve.structured.compiler import CompiledGrammar


class GrammarStateError(KVServeError):
    """A token reached a grammar that refuses it (a bug or a trigger token the grammar cannot continue)."""


class GrammarMatcher:
    """A request's matcher. `force` False turns forced tokens off (benchmarks compare both)."""

    def __init__(self, compiled: CompiledGrammar, vocabulary: llguidance.LLTokenizer, trigger: str | None = None,
                 force: bool = True, after: str | None = None, after_open: str | None = None) -> None:
        self._state = compiled.new_state()
        self._first_mask = compiled.first_mask  # the initial state's, computed once per grammar
        self._vocabulary = vocabulary
        # What free text must contain before the grammar starts, in order: `after` (a reasoning model's end of
        # thinking), then the trigger.
        self._awaited = [marker.encode() for marker in (after, trigger) if marker is not None]
        self._tail = b""  # the free text's last bytes, where an awaited text may be starting
        # With `after_open`: its first token, which the output's first token is or is not (then `after` is not
        # awaited, and the token goes on to what comes next); decided at the first token.
        self._opening: int | None = None
        if after is not None and after_open is not None:
            self._opening = vocabulary.tokenize_bytes(after_open.encode())[0]
        self._free_first = trigger is not None  # (in trigger mode the first token is free either way)
        self.force = force
        self.num_consumed = 0  # tokens consumed by the grammar (after any trigger)

    @property
    def constrained(self) -> bool:
        """Whether the grammar constrains the next token (False while a trigger is awaited; the first token of
        an output that may open its thinking is the grammar's or that opening)."""
        return not self._awaited or (self._opening is not None and not self._free_first)

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
        else:
            self._state.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            self._check()
        if self._opening is not None:  # the first token may open the thinking instead
            row[self._opening // 32] |= _bit(self._opening % 32)

    def consume(self, token_ids: list[int]) -> None:
        """Advance over accepted tokens (free text first, in trigger mode)."""
        for index, token in enumerate(token_ids):
            if self._opening is not None:
                self._first(token)
                continue
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
        if not self.force or limit <= 0 or not self.constrained or self._opening is not None or \
                self._state.is_stopped():
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

    def _first(self, token: int) -> None:
        """The output's first token: it opens the thinking (whose end is awaited), or it does not (the end of
        thinking is not awaited, and the token is the trigger's watch's or the grammar's)."""
        # (a token that may also start the answer counts as the opening: where a vocabulary splits `<think>` as
        # it splits `<tool_call>`, an answer left free is still parsed, a thinking constrained would be cut)
        opened, self._opening = token == self._opening, None
        if not opened:
            self._awaited.pop(0)
        self.consume([token])

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
