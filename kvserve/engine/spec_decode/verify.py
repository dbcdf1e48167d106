"""Draft verification that leaves the output distribution exactly the target model's.

A draft here is a point mass (the proposers are deterministic), and the
verification is rejection sampling with the maximal coupling: at each draft's
row the target's token is drawn as the sampler draws it (one uniform from the
request's generator, the inverse-CDF token of the processed distribution p:
penalties, temperature, top-k/top-p/min-p); the draft d is accepted iff that
token is d, otherwise the drawn token replaces it and the step ends. So d is
accepted with probability p(d), and on rejection the token follows p with d
removed, renormalized: exactly speculative sampling's rule for q = the point
mass at d, every accepted token distributed as p. If every draft is accepted,
the row after the last gives one more token as usual. Greedy requests are the
limit: accept d iff it is the argmax.

Because each output token takes one uniform, drafted or not, a seeded request
produces the same tokens with drafting on, off, or at any k (and so whatever
the batch does to k). Row i's penalties count the drafts before it as
accepted (if row i is reached, they were), so repetition/presence/frequency
penalties see the history a request without drafting would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.sample.sampling import SamplingParams, sample


def verify_drafts(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams, generator: torch.Generator,
                  seen: torch.Tensor | None, output_counts: torch.Tensor | None) -> list[int]:
    """The tokens a request accepts from `logits` (`[len(drafts) + 1, vocab]`, row i predicting the token
    after draft i - 1): the accepted drafts, then one token of the target's own. `seen` / `output_counts`
    (the penalty state before this step) are not modified."""
    accepted: list[int] = []
    for row, draft in enumerate(drafts):
        token = sample(logits[row], params, generator, seen, output_counts)
        if token != draft:
            return [*accepted, token]
        accepted.append(draft)
        seen, output_counts = _with_token(seen, output_counts, draft)
    return [*accepted, sample(logits[len(drafts)], params, generator, seen, output_counts)]


def _with_token(seen: torch.Tensor | None, output_counts: torch.Tensor | None,
                token: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The penalty state with one more accepted token (copies: the request's own state counts accepted
    tokens only, once the step is over)."""
    if seen is not None:
        seen = seen.clone()
        seen[token] = True
    if output_counts is not None:
        output_counts = output_counts.clone()
        output_counts[token] += 1
    return seen, output_counts
