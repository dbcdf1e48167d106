"""Draft verification that leaves the output distribution exactly the target model's.

A draft here is a point mass (the proposers are deterministic): for draft d at
row i, with p the target's processed distribution at that row (penalties,
temperature, top-k/top-p/min-p, as the sampler applies them), accept d with
probability p(d); on rejection, sample from p with d removed, renormalized, and
stop. If every draft is accepted, the row after the last one gives one more
token as usual. Each position's token is then distributed exactly as p
(P(d) = p(d); P(x != d) = (1 - p(d)) * p(x) / (1 - p(d))), which is the
speculative sampling theorem with q = the point mass at d. Greedy requests are
the limit: accept d iff it is the argmax.

Row i's penalties count the drafts before it as accepted (if row i is reached,
they were), so repetition/presence/frequency penalties see the same history a
request without drafting would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.sampling import SamplingParams, penalized_logits, target_probabilities


def verify_drafts(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams, generator: torch.Generator,
                  seen: torch.Tensor | None, output_counts: torch.Tensor | None) -> list[int]:
    """The tokens a request accepts from `logits` (`[len(drafts) + 1, vocab]`, row i predicting the token
    after draft i - 1): the accepted drafts, then one token of the target's own. `seen` / `output_counts`
    (the penalty state before this step) are not modified."""
    accepted: list[int] = []
    for row, draft in enumerate(drafts):
        token = _verify_one(logits[row], draft, params, generator, seen, output_counts)
        if token != draft:
            return [*accepted, token]
        accepted.append(draft)
        seen, output_counts = _with_token(seen, output_counts, draft)
    return [*accepted, _sample_row(logits[len(drafts)], params, generator, seen, output_counts)]


def _verify_one(row: torch.Tensor, draft: int, params: SamplingParams, generator: torch.Generator,
                seen: torch.Tensor | None, output_counts: torch.Tensor | None) -> int:
    """`draft` if accepted, else the replacement sampled from the remainder."""
    logits = penalized_logits(row, params, seen, output_counts)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = target_probabilities(logits, params)
    probs = probs / probs.sum()
    p_draft = float(probs[draft])
    if float(torch.rand((), generator=generator)) < p_draft:
        return draft
    remainder = probs.clone()
    remainder[draft] = 0.0
    if float(remainder.sum()) <= 0.0:  # p(d) rounded to 1 yet u >= p(d): d is the only token left
        return draft
    return int(torch.multinomial(remainder, 1, generator=generator))


def _sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                seen: torch.Tensor | None, output_counts: torch.Tensor | None) -> int:
    logits = penalized_logits(row, params, seen, output_counts)
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(target_probabilities(logits, params), 1, generator=generator))


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
