"""Recently finished requests and their prefix-cache reports, for the explainer page.

An AsyncEngine observer (like the metrics): it sees each request's final
delta and keeps the last few. Prompt token ids are kept only with
--log-prompts, since the page would show their text.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvserve.engine.output.types import PrefixCacheReport, RequestDelta
from kvserve.model.tokenizer import Tokenizer

RECENT_REQUESTS = 32


@dataclass(frozen=True)
class RecentRequest:
    request_id: str
    finished_at: float  # time.time()
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    ttft: float | None
    tpot: float | None
    report: PrefixCacheReport
    prompt_token_ids: tuple[int, ...] | None  # only with --log-prompts


class RecentRequests:
    def __init__(self, keep_prompts: bool, size: int = RECENT_REQUESTS) -> None:
        self.keep_prompts = keep_prompts
        self.size = size
        self._recent: deque[RecentRequest] = deque(maxlen=size)

    def observe(self, delta: RequestDelta) -> None:
        """AsyncEngine observer: keep each finished request that was admitted (it has a report)."""
        if not delta.finished or delta.prefix_cache is None:
            return
        m = delta.metrics
        prompt = tuple(delta.prompt_token_ids) if self.keep_prompts else None
        self._recent.append(RecentRequest(delta.request_id, time.time(), m.num_prompt_tokens, m.num_output_tokens,
                                          delta.finish_reason, m.ttft, m.tpot, delta.prefix_cache, prompt))

    def newest_first(self) -> list[RecentRequest]:
        return list(reversed(self._recent))

    def get(self, request_id: str) -> RecentRequest | None:
        return next((r for r in self._recent if r.request_id == request_id), None)


def explanation_json(report: PrefixCacheReport, prompt_token_ids: list[int] | tuple[int, ...] | None,
                     tokenizer: Tokenizer | None, show_prompt_text: bool, show_cached_text: bool) -> dict:
    """A report as the explainer shows it. With `show_prompt_text`, this prompt's text split where the
    cache stopped serving it (needs `prompt_token_ids`); with `show_cached_text` (--log-prompts), the
    text of the cached prompt it diverged from, which is another request's."""
    body = {
        "num_prompt_tokens": report.num_prompt_tokens, "num_cached_tokens": report.num_cached_tokens,
        "reason": report.reason, "divergence_position": report.divergence_position,
        "cached_text_shown": show_cached_text,
    }
    if show_prompt_text and prompt_token_ids is not None and tokenizer is not None:
        ids = list(prompt_token_ids)
        cut = report.num_cached_tokens
        # Three spans of this prompt: served from the cache, computed but matching a cached block up to
        # the divergence, and the rest. Without a divergence nothing cached goes on past the cut, so
        # nothing is "matched": the rest starts where the cache stopped.
        split = max(cut, report.divergence_position if report.divergence_position is not None else cut)
        body["prompt"] = {"cached": tokenizer.decode(ids[:cut]), "matched": tokenizer.decode(ids[cut:split]),
                          "rest": tokenizer.decode(ids[split:])}
    if report.divergence_position is not None:
        body["divergence"] = {"common": report.common_text if show_prompt_text else None,
                              "prompt": report.prompt_continuation if show_prompt_text else None,
                              "cached": report.cached_continuation if show_cached_text else None}
    return body
