"""A compiled grammar tried for a few tokens before any request uses it: the failures llguidance finds only
when it computes masks (a `$ref` that only refers to itself allows nothing at the first mask; 5,000
optional properties overflow a parser row at the first token; a regex's lexer blows up after some
letters) become a 400 at validation instead of a request that fails mid-stream.

The walk takes, at each step, the longest token the mask allows (the most bytes per step, so the lexer
and parser see the most of the grammar early), consuming forced tokens as the engine does. It runs once
per grammar (the compiler caches the result with it), a few masks (~0.1 ms each for a usual schema).
"""

from __future__ import annotations

import logging

import llguidance
import numpy as np
import torch

from kvserve.structured.mask import bitmask_words

log = logging.getLogger(__name__)

PROBE_TOKENS = 16
# llguidance's reasons to stop that mean the grammar itself is at fault, in words a client can act on.
_REASONS = {"NoExtensionBias": "it allows no output at all (a $ref that only refers to itself?)"}


def longest_first(vocabulary: llguidance.LLTokenizer) -> np.ndarray:
    """Token ids, most bytes first (once per vocabulary), the end-of-output tokens last: the walk ends the
    output only where nothing else is allowed."""
    lengths = np.array([len(vocabulary.decode_bytes([t])) for t in range(vocabulary.vocab_size)], dtype=np.int64)
    lengths[list(vocabulary.eos_tokens)] = -1
    return np.argsort(-lengths, kind="stable")


def short_error(error: str) -> str:
    """llguidance's error without the engine state it dumps after it (kept for the log)."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown grammar error"
    return _REASONS.get(first, first)


def probe(initial: llguidance.LLMatcher, order: np.ndarray, steps: int = PROBE_TOKENS
          ) -> tuple[torch.Tensor, str | None]:
    """(the first mask, the grammar's error within `steps` tokens or None). `initial` is not moved."""
    matcher = initial.deep_copy()
    row = torch.zeros(bitmask_words(order.size), dtype=torch.int32)
    first: torch.Tensor | None = None
    for _ in range(steps):
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if first is None:
            first = row.clone()
        if matcher.is_error() or matcher.is_stopped() or not _advance(matcher, row, order):
            break
    if not matcher.is_error():
        return first, None
    error = matcher.get_error()
    log.warning("a grammar fails in its first tokens: %s", error)
    return first, short_error(error)


def _advance(matcher: llguidance.LLMatcher, row: torch.Tensor, order: np.ndarray) -> bool:
    """Consume the longest allowed token (and what it forces), preferring one after which the grammar goes
    on (`{}` ends an object of optional properties; `{"` reaches them); False when nothing is allowed."""
    allowed = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:order.size].astype(bool)
    candidates = order[allowed[order]][:4]
    for n, token in enumerate(candidates.tolist()):
        if not matcher.consume_token(token):
            return False
        if matcher.is_stopped() and n + 1 < len(candidates):
            matcher.rollback(1)
            continue
        forced = matcher.compute_ff_tokens()
        return not forced or matcher.consume_tokens(forced)
    return False
