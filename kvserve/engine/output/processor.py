"""A step's accepted tokens -> what each request gained: stop conditions, text, and the engine's deltas.

vLLM's OutputProcessor. The scheduler only advances progress; here each
request's accepted tokens are checked in order against its stop conditions,
detokenized and turned into a RequestDelta. A multi-token step (drafts
verified, forced tokens) may finish a request in the middle of its list: the
tokens after the one that stops it are dropped, as if they had never been
produced.
"""

from __future__ import annotations

from kvserve.engine.output.detokenizer import IncrementalDetokenizer
from kvserve.engine.output.types import PrefixCacheReport, RequestDelta
from kvserve.engine.output.prefix_report import build_prefix_report
from kvserve.engine.request import Request
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kv.manager import KVCacheManager
from kvserve.model.tokenizer import Tokenizer


class OutputTracker:
    """Follows one request's accepted tokens and decides when it is finished.

    Stops on the model's EOS / end-of-turn tokens (unless ignore_eos), on
    `stop_token_ids`, on stop strings (found even when they span tokens; the
    stop string and what follows are not part of the text), or at max_tokens.
    While running, `take_delta()` withholds the last len(longest stop) - 1
    characters, which could still turn out to begin a stop string.
    """

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        if params.stop and tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model was loaded without one")
        self.params = params
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if tokenizer else None
        self._eos_ids = frozenset() if params.ignore_eos or tokenizer is None else tokenizer.stop_token_ids
        self._stop_ids = frozenset(params.stop_token_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._emitted = 0  # characters of `text` already handed out as deltas
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token_ids: list[int]) -> list[int]:
        """Record tokens in order until one finishes the request; returns those recorded (the finishing
        one included, the ones after it dropped)."""
        for count, token_id in enumerate(token_ids, 1):
            if self.append(token_id) is not None:
                return token_ids[:count]
        return token_ids

    def append(self, token_id: int) -> str | None:
        """Record one token; returns the finish reason once finished ("stop" / "length")."""
        self.token_ids.append(token_id)
        if token_id in self._eos_ids or token_id in self._stop_ids:
            self.finish("stop")
            return self.finish_reason
        if self._detokenizer is not None:
            searched_from = max(len(self.text) - self._holdback, 0)
            self.text += self._detokenizer.add(token_id)
            if self._find_stop_string(searched_from):
                return self.finish_reason
        if len(self.token_ids) >= self.params.max_tokens:
            self.finish("length")
        return self.finish_reason

    def _find_stop_string(self, searched_from: int) -> bool:
        hits = [i for i in (self.text.find(s, searched_from) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.finish_reason = "stop"
        return True

    def finish(self, reason: str) -> None:
        """Finish now (also from outside: a structured output's grammar completes), flushing the text."""
        if self._detokenizer is not None:
            searched_from = max(len(self.text) - self._holdback, 0)
            self.text += self._detokenizer.flush()
            self._find_stop_string(searched_from)
        if self.finish_reason is None:
            self.finish_reason = reason

    def take_delta(self) -> str:
        """Text not yet handed out that is safe to show now."""
        end = len(self.text) if self.finished else max(len(self.text) - self._holdback, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


class OutputProcessor:
    """Every unfinished request's OutputTracker, and the deltas built from them.

    With a KV manager (`kv`), deltas report the KV memory a request holds and
    its prefix-cache report; without one (scheduler tests) they leave both out.
    """

    def __init__(self, tokenizer: Tokenizer | None, kv: KVCacheManager | None = None, page_bytes: int = 0,
                 prefix_caching: bool = False) -> None:
        self.tokenizer = tokenizer
        self.kv = kv
        self.page_bytes = page_bytes  # one block's bytes; 0: the blocks are scratch, not a cache
        self.prefix_caching = prefix_caching
        self._trackers: dict[str, OutputTracker] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Start tracking a request; raises InvalidRequestError for conditions it cannot check."""
        self._trackers[request_id] = OutputTracker(params, self.tokenizer)

    def tracker(self, request_id: str) -> OutputTracker:
        return self._trackers[request_id]

    def remove(self, request_id: str) -> None:
        self._trackers.pop(request_id, None)

    def accept(self, request: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Append a step's accepted tokens to `request`, up to the first that finishes it; returns
        the tokens appended and the finish reason (None while it goes on)."""
        tracker = self._trackers[request.request_id]
        kept = tracker.accept(token_ids)
        request.append_output_tokens(kept)
        return kept, tracker.finish_reason

    def delta(self, request: Request, new_token_ids: list[int], error: str | None = None) -> RequestDelta:
        """What this step added to `request`: O(1) in its length (nothing cumulative is copied)."""
        tracker = self._trackers.get(request.request_id)
        new_logprobs, new_prompt_logprobs = request.take_new_logprobs()
        return RequestDelta(
            request.request_id, request.prompt, request.prompt_token_ids, new_token_ids,
            tracker.take_delta() if tracker is not None else "", request.finish_reason, request.finished,
            request.metrics, num_cached_tokens=request.num_cached_tokens or 0,
            num_dropped_tokens=request.num_dropped_prompt_tokens,
            kv_cache_bytes=self._held_bytes(request), prefix_cache=self._prefix_report(request),
            new_logprobs=new_logprobs, new_prompt_logprobs=new_prompt_logprobs, error=error,
        )

    def _prefix_report(self, request: Request) -> PrefixCacheReport | None:
        if request.num_cached_tokens is None or self.kv is None:
            return None  # not admitted yet
        if request.prefix_cache_report is None:  # once per request, not on every step's output
            request.prefix_cache_report = build_prefix_report(request, self.prefix_caching, self.kv.block_size,
                                                              self.tokenizer)
        return request.prefix_cache_report

    def _held_bytes(self, request: Request) -> int:
        """KV memory the request holds now (when finished: what it held when it finished)."""
        if self.kv is None:
            return 0
        blocks = request.kv_blocks_held if request.finished else self.kv.num_blocks_held(request.request_id)
        return blocks * self.page_bytes
