"""An output that never contains a given text (tool_choice "none": the tools stay in the prompt, so the cache
does not change with tool_choice, but the model may not open a call), by a token ban.

Whether a token would complete the text depends only on how many of the text's first bytes the output
ends with (its state, 0 to len - 1, as in Knuth-Morris-Pratt): a token completes it from state k exactly
when the text is in `text[:k] + token`. The banned tokens of each state are found once per vocabulary; a
step then costs nothing in the usual states, where no token is banned (the sampler is not masked at
all), and a row copy in the others. A grammar saying the same (llguidance's `~` lexeme) cost ~0.4 ms a
step, a few percent of a decode step.
"""

from __future__ import annotations

import llguidance
import torch

from kvserve.structured.mask import bitmask_words
from kvserve.structured.matcher import GrammarStateError


class ExcludedText:
    """One text's banned tokens per state, for one vocabulary (shared by every request that excludes it)."""

    def __init__(self, vocabulary: llguidance.LLTokenizer, text: str) -> None:
        self.text = text
        self.pattern = text.encode()
        self._vocabulary = vocabulary
        n = vocabulary.vocab_size
        # Only a token holding the text's last byte can complete it: a cheap filter before the real check.
        last = self.pattern[-1:]
        candidates = [(t, data) for t in range(n) if last in (data := vocabulary.decode_bytes([t]))]
        self.banned = [[t for t, data in candidates if self.pattern in self.pattern[:k] + data]
                       for k in range(len(self.pattern))]
        self._rows: list[torch.Tensor | None] = [self._row(banned, n) if banned else None for banned in self.banned]

    @staticmethod
    def _row(banned: list[int], vocab_size: int) -> torch.Tensor:
        """An allowed-token bitmask row (llguidance's layout) with every token but `banned` allowed."""
        row = torch.full((bitmask_words(vocab_size),), -1, dtype=torch.int32)
        for token in banned:
            row[token // 32] &= ~(1 << (token % 32))
        return row

    def row(self, state: int) -> torch.Tensor | None:
        """The bitmask of `state`, None where nothing is banned."""
        return self._rows[state]

    def step(self, state: int, token: int) -> int:
        """The state after `token`; GrammarStateError if the token completes the text."""
        data = self.pattern[:state] + self._vocabulary.decode_bytes([token])
        if self.pattern in data:
            raise GrammarStateError(f"token {token} completes the excluded text {self.text!r}")
        for k in range(min(len(data), len(self.pattern) - 1), 0, -1):
            if data.endswith(self.pattern[:k]):
                return k
        return 0


class ExcludedTextMatcher:
    """A request's state against an ExcludedText, with GrammarMatcher's interface (nothing is ever forced and
    the output is never complete by it)."""

    force = False
    is_stopped = False

    def __init__(self, excluded: ExcludedText) -> None:
        self._excluded = excluded
        self._state = 0
        self.num_consumed = 0

    @property
    def constrained(self) -> bool:
        """Whether the next token is masked: only where some token would complete the text."""
        return self._excluded.row(self._state) is not None

    def fill_bitmask(self, row: torch.Tensor) -> None:
        mask = self._excluded.row(self._state)
        row.copy_(mask if mask is not None else torch.full_like(row, -1))

    def consume(self, token_ids: list[int]) -> None:
        for token in token_ids:
            self._state = self._excluded.step(self._state, token)
            self.num_consumed += 1

    def take_forced(self, limit: int) -> list[int]:
        return []

    def rollback(self, num_tokens: int) -> None:
        raise GrammarStateError("an excluded-text constraint does not roll back")
