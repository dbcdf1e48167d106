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


class NgramProposer:
    """Drafts from the request's own tokens (prompt lookup). Stateless between steps."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, tenant: str | None = None
                ) -> list[int]:
        return find_continuation(token_ids, max_tokens, self.min_n, self.max_n)[1]

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Prompt lookup learns nothing; the drafting policy adapts k (engine/spec_decode/policy.py)."""

    def finish(self, request_id: str, tenant: str | None, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Nothing is kept across requests."""
