"""The token ids an answer that made tool calls was generated as, for the turn that sends it back.

The next turn's prompt renders a stored call to the very text the model wrote (tools/calls.py, or the
template's own layout, which the grammar forces), but the tokenizer does not always split that text as
the model did (SmolLM2 generated `"}` + `}` where the tokenizer writes `"` + `}}`), and from the first
differing token on, the cache misses. So the server remembers, per tenant and bounded (least recently
used go first), the output ids of each answer that made calls, by its first call id (every API echoes
call ids back: OpenAI's `tool_calls[].id`, Anthropic's `tool_use.id`, Responses' `call_id`). The
builder splices them in where the rendering still holds that answer's text (builder.py).

A replica also queues what it remembers (`take_new`) so the ingress that routes to it can remember the
same answers and hash the next turn exactly as the replica will (replicas/routing_key.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.tools.rendering import Turn

DEFAULT_MAX_TOKENS = 4_000_000  # ~16 MB of ids: thousands of tool loops' answers


@dataclass(frozen=True)
class GeneratedAnswer:
    text: str  # the answer's text, as the model wrote it
    token_ids: tuple[int, ...]  # its output ids (with the end-of-turn token if it produced one)


@dataclass(frozen=True)
class RememberedAnswer:
    """One `remember` call, as a replica forwards it to the ingress."""

    tenant: str
    call_id: str
    text: str
    token_ids: tuple[int, ...]


class GeneratedAnswers:
    """(tenant, first call id) -> the answer that made the call. Thread-safe (workers read, the loop writes).
    `forward`: also queue each remembered answer for `take_new` (a replica behind an ingress)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, forward: bool = False) -> None:
        self.max_tokens = max_tokens
        self._answers: OrderedDict[tuple[str, str], GeneratedAnswer] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        self._forward = forward
        self._new: list[RememberedAnswer] = []

    def remember(self, tenant: str, call_id: str, text: str, token_ids: Sequence[int]) -> None:
        answer = GeneratedAnswer(text, tuple(token_ids))
        with self._lock:
            old = self._answers.pop((tenant, call_id), None)
            self._num_tokens += len(answer.token_ids) - (len(old.token_ids) if old else 0)
            self._answers[(tenant, call_id)] = answer
            while self._num_tokens > self.max_tokens and self._answers:
                _, dropped = self._answers.popitem(last=False)
                self._num_tokens -= len(dropped.token_ids)
            if self._forward:
                self._new.append(RememberedAnswer(tenant, call_id, text, answer.token_ids))
                del self._new[:-1024]  # an ingress that never collects them does not grow this

    def lookup(self, tenant: str, turn: Turn) -> GeneratedAnswer | None:
        """The answer remembered for an assistant turn's calls (None: none, or not a turn with calls). The
        caller checks that the turn still renders to its text before using its ids."""
        if turn.role != "assistant" or not turn.tool_calls:
            return None
        with self._lock:
            answer = self._answers.get((tenant, turn.tool_calls[0].id))
            if answer is not None:
                self._answers.move_to_end((tenant, turn.tool_calls[0].id))
            return answer

    def take_new(self) -> list[RememberedAnswer]:
        """What was remembered since the last call (only with `forward`)."""
        with self._lock:
            new, self._new = self._new, []
            return new
