"""The drafting seam: a Proposer guesses the tokens that follow a request; the next step verifies them.

After each step, every decoding request that drafting applies to gets up to
`num_speculative_tokens` guesses (`Request.draft_token_ids`). The scheduler
gives them slots after the request's last token, the runner computes them in
the same forward as everything else, and the acceptor keeps the longest
prefix the model agrees with (engine/acceptance.py), plus the model's own
next token. Rejected guesses' K/V is truncated (KVCacheManager.truncate);
nothing past the accepted tokens is ever hashed into the prefix cache.

Verification is greedy: drafts are proposed for plain greedy requests only
(no temperature, no penalties), where the output with drafting equals the
output without it token for token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvserve.engine.request import Request


class Proposer(Protocol):
    """Guesses a request's next tokens from what it has (prompt + output so far)."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that may follow `token_ids` (fewer, or none, when unsure)."""
        ...

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """How many of the last proposal's tokens the model accepted: what an adaptive proposer learns from."""
        ...


def can_draft(request: Request) -> bool:
    """Greedy verification keeps the output exact only where the output is the argmax of the logits."""
    params = request.sampling_params
    return params.greedy and params.repetition_penalty == 1.0 and not params.penalizes_output


class Drafting:
    """Asks the proposer for the requests drafting applies to, within their output and context limits."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, running: Iterable[Request]) -> None:
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1 or not can_draft(request):
                continue
            # Guesses past max_tokens or past the context would be thrown away unread.
            room = min(self.num_speculative_tokens,
                       request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                       self.max_model_len - request.num_tokens)
            if room > 0:
                request.draft_token_ids = list(self.proposer.propose(request.request_id, request.all_token_ids,
                                                                     room))[:room]

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.proposer.observe(request_id, num_proposed, num_accepted)
