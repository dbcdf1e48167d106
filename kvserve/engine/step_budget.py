"""How many prompt tokens a step may take while several requests have work: the step-time target in tokens.

A step is one forward, and nobody's next token comes before it ends: a newcomer waits for the step in flight
and then for its own, a running stream for every step. A full step of prompt tokens takes seconds on a CPU, so
while more than one request has work the scheduler cuts prefill to what this engine computes in
`step_target_ms` (EngineConfig), measured: an exponential average of the seconds per token of past steps with
enough tokens to say (a few decodes are mostly fixed cost). The step's fixed cost stays in the average, so the
estimate errs short. Until a step has been measured there is no cut.

The engine times steps and sets the scheduler's budget from here: the scheduler itself never reads a clock.
Which tokens run stays batch-invariant, so a cut changes when tokens come, never which.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps with fewer tokens say more about the step's fixed cost than about a token's.
MIN_SAMPLE_TOKENS = 32
# Weight of the newest step in the average: ~10 steps of memory, so a change of load shows within a second.
SMOOTHING = 0.2


@dataclass
class StepBudget:
    """The measured rate and the target it turns into tokens (`contended_tokens`)."""

    target_ms: int  # 0: no cut
    max_tokens: int  # the step's budget anyway (max_num_batched_tokens)
    min_tokens: int  # a step's prompt tokens are never cut below this (a block: prefill always moves)
    seconds_per_token: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` in `seconds` (its whole forward and sampling)."""
        if num_tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return
        rate = seconds / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = rate if previous is None else previous + SMOOTHING * (rate - previous)

    def contended_tokens(self) -> int | None:
        """Tokens a step should take at most while several requests have work (None: no cut, as yet or at all)."""
        if not self.target_ms or self.seconds_per_token is None:
            return None
        fitting = int(self.target_ms / 1000 / self.seconds_per_token)
        return max(self.min_tokens, min(self.max_tokens, fitting))


def prefill_budget(left: int, step_tokens: int, contended: int | None, min_tokens: int) -> int:
    """What the decodes `left` of a step's `step_tokens` for prompt tokens, cut to `contended` tokens in all (less
    what the decodes took, but never below `min_tokens`) where given: while more than one request has work."""
    if contended is None:
        return left
    return min(left, max(contended - (step_tokens - left), min_tokens))
