"""Prompt lookup (vLLM's `ngram`, llama.cpp's `ngram-*` draft types): drafts copied from the request itself.

The longest suffix of the request's tokens (prompt + output so far), between
`min_n` and `max_n` tokens, that occurred earlier in them is looked up; the
tokens that followed its most recent earlier occurrence are the draft. Output
that repeats its input (an edited file, a quote, a tool call echoed back) is
drafted whole; prose rarely matches at all, so it costs nothing but the lookup.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Only the last tokens are searched: a lookup is O(window) per request per step, and what an output
# copies is almost always recent (its prompt, its own last lines). 8k tokens is ~20 us of numpy.
SEARCH_WINDOW = 8192


def find_continuation(token_ids: Sequence[int], max_tokens: int, min_n: int, max_n: int,
                      window: int = SEARCH_WINDOW) -> tuple[int, list[int]]:
    """(match length, the tokens that followed the most recent earlier occurrence of the longest suffix
    of `token_ids` that occurred earlier); (0, []) when no suffix of at least `min_n` tokens did."""
    tokens = np.asarray(token_ids[-window:] if len(token_ids) > window else token_ids, dtype=np.int64)
    total = len(tokens)
    if max_tokens < 1 or total < min_n + 1:
        return 0, []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # Windows starting at 0 .. total-n-1: every earlier occurrence (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return n, tokens[start:start + max_tokens].tolist()
    return 0, []


# Earlier occurrences of the last token examined per lookup, most recent first: enough for any text
# that is being copied, and a bound on a lookup's cost in text where one token recurs a lot.
MAX_CANDIDATES = 64
# Tokens compared to tell that a request's tokens are still the ones indexed (a context shift rewrites them).
_CHECK = 4


class TokenPositions:
    """One request's tokens indexed by value, extended as they grow: a lookup costs O(candidates x max_n),
    not a scan of the whole sequence (which was ~0.3 ms per step at 700 tokens, 5% of a decode step)."""

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}
        self.length = 0
        self.check: list[int] = []

    def update(self, token_ids: Sequence[int]) -> None:
        # A stale index (after a context shift) would only draft worse guesses, never wrong output: the
        # verify keeps output exact. Rebuild when the tokens before the indexed end changed.
        if len(token_ids) < self.length or list(token_ids[self.length - len(self.check):self.length]) != self.check:
            self.positions, self.length = {}, 0
        for index in range(self.length, len(token_ids)):
            self.positions.setdefault(token_ids[index], []).append(index)
        self.length = len(token_ids)
        self.check = list(token_ids[max(self.length - _CHECK, 0):])

    def lookup(self, token_ids: Sequence[int], max_tokens: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
        """As find_continuation, over the indexed tokens (call `update` first)."""
        total = len(token_ids)
        if max_tokens < 1 or total < min_n + 1:
            return 0, []
        best_n, best_end = 0, -1
        candidates = self.positions.get(token_ids[-1], [])
        for end in reversed(candidates[-MAX_CANDIDATES - 1:-1] if candidates and candidates[-1] == total - 1
                            else candidates[-MAX_CANDIDATES:]):
            n = 1
            limit = min(max_n, end + 1)
            while n < limit and token_ids[end - n] == token_ids[total - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == max_n:
                    break
        if best_n < min_n:
            return 0, []
        return best_n, list(token_ids[best_end + 1:best_end + 1 + max_tokens])


class NgramProposer:
    """Drafts from the request's own tokens (prompt lookup), indexed per request as they grow."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._requests: dict[str, TokenPositions] = {}

    def lookup(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """(match length, draft) for the request."""
        index = self._requests.setdefault(request_id, TokenPositions())
        index.update(token_ids)
        return index.lookup(token_ids, max_tokens, self.min_n, self.max_n)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, tenant: str | None = None
                ) -> list[int]:
        return self.lookup(request_id, token_ids, max_tokens)[1]

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Prompt lookup learns nothing; the drafting policy adapts k (engine/spec_decode/policy.py)."""

    def finish(self, request_id: str, tenant: str | None, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Nothing is kept across requests."""
        self._requests.pop(request_id, None)
