"""How many tokens to draft for a request this step: k adapts to its measured acceptance and to the cost
of verifying a token at the current batch size, and is 0 where drafting would not pay.

A verify step computes 1 + k tokens for the request instead of 1. Its expected
yield is 1 + a + a^2 + ... + a^k tokens (a: the chance that a draft token is
accepted given the ones before it were, measured per request), and its cost, in
units of what one plain decode token costs at this batch size, is 1 + k * c(B),
where c(B) is the marginal cost of one more query token in the step (measured on
this CPU by `bench/spec_decode.py cost`). At batch 1 a decode step is
weight-bound (reading the weights once is the floor) and more query tokens are
nearly free; in a big batch a token costs about what a token costs. The best k
maximizes yield / cost; where even k = 1 yields less than it costs, the request
does not draft (in "auto"; an explicit method drafts at least 1 token), and
probes again now and then in case its text became repetitive.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Marginal cost of one more query token in a decode step, as a fraction of a plain decode token's share
# of that step, by batch size (decoding requests). Measured with `bench/spec_decode.py cost` on this
# project's shared 2-core Xeon (SmolLM2-135M int4, fp16 KV cache, ~300-token contexts, 4 drafts per request,
# medians of 30 alternating plain / verify steps; see the README's speculative decoding section);
# interpolated between the points, flat past the last. A verify's queries run as one-token decodes through
# the batched decode kernel (engine/runner.py), so at small batches they cost little beside the weights'
# read; in bigger batches the int4 matmul's work grows with the rows.
DRAFT_TOKEN_COST: tuple[tuple[int, float], ...] = ((1, 0.11), (4, 0.11), (16, 0.38), (32, 0.56))
# Prior acceptance (pseudo-counts): an unknown request starts at a = 2 / 3, hopeful but quick to learn.
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0
# Older verifies weigh less: the text a request copies changes (a quote ends, prose starts).
DECAY = 0.8
# Drafting must beat not drafting by this margin in "auto": noise in a and c is not worth chasing.
MIN_GAIN = 1.05
# A request that stopped drafting tries one token every this many steps.
PROBE_INTERVAL = 16


def draft_token_cost(batch_size: int) -> float:
    sizes = [size for size, _ in DRAFT_TOKEN_COST]
    i = bisect.bisect_right(sizes, batch_size)
    if i == 0:
        return DRAFT_TOKEN_COST[0][1]
    if i == len(sizes):
        return DRAFT_TOKEN_COST[-1][1]
    (lo, lo_cost), (hi, hi_cost) = DRAFT_TOKEN_COST[i - 1], DRAFT_TOKEN_COST[i]  # lo <= batch_size < hi
    return lo_cost + (hi_cost - lo_cost) * (batch_size - lo) / (hi - lo)


def expected_yield(acceptance: float, k: int) -> float:
    """Tokens a verify of k drafts accepts on average: the model's own token plus a + a^2 + ... + a^k."""
    return 1.0 + sum(acceptance**i for i in range(1, k + 1))


def best_k(acceptance: float, cost: float, max_k: int, min_k: int = 0, min_gain: float = 1.0) -> int:
    """The k in [min_k, max_k] with the most tokens per unit of step cost (0 unless it beats 1 by min_gain)."""
    best, best_rate = 0, 1.0 * min_gain
    for k in range(max(min_k, 1), max_k + 1):
        rate = expected_yield(acceptance, k) / (1.0 + k * cost)
        if rate > best_rate or (best == 0 and min_k > 0):
            best, best_rate = k, rate
    return best


@dataclass(slots=True)
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED  # draft tokens accepted (decayed)
    rejected: float = PRIOR_REJECTED  # verifies that ended at a rejected draft (decayed)
    idle_steps: int = 0  # steps since it last drafted

    @property
    def rate(self) -> float:
        """Per-token acceptance (the geometric model's MLE: each verify ends at its first rejection)."""
        return self.accepted / (self.accepted + self.rejected)


class DraftPolicy:
    """Per request: its acceptance, and the k it drafts given the batch size."""

    def __init__(self, max_k: int, auto_off: bool = True) -> None:
        if max_k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {max_k}")
        self.max_k = max_k
        self.auto_off = auto_off  # "auto": k may be 0; an explicit method drafts at least 1
        self._requests: dict[str, _Acceptance] = {}

    def num_tokens(self, request_id: str, batch_size: int) -> int:
        """How many tokens to draft for this request in a step of `batch_size` decodes."""
        state = self._requests.setdefault(request_id, _Acceptance())
        cost = draft_token_cost(batch_size)
        k = best_k(state.rate, cost, self.max_k, min_k=0 if self.auto_off else 1,
                   min_gain=MIN_GAIN if self.auto_off else 1.0)
        if k == 0 and self.auto_off and best_k(1.0, cost, self.max_k, min_gain=MIN_GAIN) > 0:
            # Off for this request, though drafts could pay at this batch size: probe now and then.
            state.idle_steps += 1
            if state.idle_steps >= PROBE_INTERVAL:
                k = 1
        return k

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        state = self._requests.setdefault(request_id, _Acceptance())
        state.idle_steps = 0
        state.accepted = state.accepted * DECAY + num_accepted
        state.rejected = state.rejected * DECAY + (1.0 if num_accepted < num_proposed else 0.0)

    def acceptance(self, request_id: str) -> float | None:
        state = self._requests.get(request_id)
        return state.rate if state is not None else None

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
