"""The drafting seam: a Proposer guesses the tokens that follow a request; the next step verifies them.

After each step, every decoding request gets up to k guesses
(`Request.draft_token_ids`), k chosen per request by the draft policy
(engine/spec_decode/policy.py: its measured acceptance against the cost of a
verified token at this batch size). The scheduler gives them slots after the
request's last token, the runner computes them in the same forward as
everything else, and the acceptor keeps what the target model's distribution
accepts (engine/sample/acceptance.py: greedy, the agreeing prefix; sampling, rejection
sampling), plus one token of the model's own. Rejected guesses' K/V is
truncated (KVCacheManager.truncate); nothing past the accepted tokens is ever
hashed into the prefix cache. Proposers live in engine/spec_decode/.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvserve.engine.request import Request
from kvserve.engine.spec_decode.policy import DraftPolicy
from kvserve.engine.spec_decode.counters import DraftCounters


class Proposer(Protocol):
    """Guesses a request's next tokens from what it has (prompt + output so far)."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int, tenant: str | None = None
                ) -> list[int]:
        """Up to `max_tokens` tokens that may follow `token_ids` (fewer, or none, when unsure). `tenant`
        (the request's cache salt) bounds what past requests' outputs a proposer may draw on."""
        ...

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """How many of the last proposal's tokens the model accepted: what an adaptive proposer learns from."""
        ...

    def finish(self, request_id: str, tenant: str | None, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """A request ended with these tokens (prompt, then output): what a cross-request proposer indexes;
        none when it was aborted or failed. Per-request state goes."""
        ...


class Drafting:
    """Asks the proposer for the decoding requests, k tokens each as the policy says, within their output
    and context limits; counts drafts and acceptances."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 policy: DraftPolicy | None = None) -> None:
        self.proposer = proposer
        self.policy = policy or DraftPolicy(num_speculative_tokens, auto_off=False)
        self.max_model_len = max_model_len
        self.counters = DraftCounters(self.policy.max_k)

    @property
    def num_speculative_tokens(self) -> int:
        return self.policy.max_k

    def propose(self, running: Iterable[Request]) -> None:
        # Constrained requests are not drafted: a guess the grammar refuses would need the matcher
        # rolled back per rejected draft, and forced tokens already skip what a grammar fixes.
        # Compressing requests are (KV compression, issue 43): a decoding request's prompt chunks are all
        # compressed, so its drafts are written after them at slot = position - dropped and verified over the
        # compressed slots; a rollback cuts only its decode tail (KVCacheManager.truncate counts slots).
        decoding = [r for r in running if r.is_decoding and r.sampling_params.structured_outputs is None]
        for request in decoding:
            # Guesses past max_tokens or past the context would be thrown away unread.
            room = min(self.policy.num_tokens(request.request_id, len(decoding)),
                       request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                       self.max_model_len - request.num_tokens)
            if room > 0:
                request.draft_token_ids = list(self.proposer.propose(
                    request.request_id, request.all_token_ids, room, tenant=request.cache_salt))[:room]

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self.policy.record(request.request_id, num_proposed, num_accepted)
        self.proposer.observe(request.request_id, num_proposed, num_accepted)
        self.counters.record(num_proposed, num_accepted)
        request.metrics.num_draft_tokens += num_proposed
        request.metrics.num_accepted_draft_tokens += num_accepted

    def finish(self, request: Request, reason: str) -> None:
        self.policy.forget(request.request_id)
        # What an aborted or failed request produced is not worth drafting from: it passes no tokens.
        token_ids = request.all_token_ids if reason in ("stop", "length") else ()
        self.proposer.finish(request.request_id, request.cache_salt, token_ids, request.num_prompt_tokens)
