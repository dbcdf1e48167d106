"""Speculative decoding counters, named as vLLM's spec-decode metrics (kvserve:spec_decode_*)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Monotonic counters as of a snapshot."""

    num_drafts: int = 0  # verifies that carried drafts
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    # acceptance_lengths[j]: drafts of which exactly j tokens were accepted (j = 0 .. max k)
    acceptance_lengths: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class DraftCounters:
    def __init__(self, max_k: int) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.acceptance_lengths = [0] * (max_k + 1)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.acceptance_lengths[min(num_accepted, len(self.acceptance_lengths) - 1)] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.acceptance_lengths))
