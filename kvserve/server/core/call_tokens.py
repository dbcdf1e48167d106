"""Token-exact tool loops on chat completions: the token ids a model generated for its tool calls, spliced
back when the client resends that assistant turn.

The next turn's prompt renders a stored call to the very text the model wrote (tools/calls.py), but
the tokenizer does not always split that text as the model did (SmolLM2 generated `"}` + `}` where
the tokenizer writes `"` + `}}`), and from the first differing token on, the cache misses. So the
server remembers, per tenant and bounded (least recently used go first), the output ids of each answer
that made calls, by its first call id. When a request's assistant turn carries that call id and still
renders to the same text, its tokens are the generated ones: the prompt is rendered with a marker in
place of that content, the pieces around it tokenized alone (a chat template closes the content with
its end-of-turn special token, where tokenization splits anyway), and the generated ids go between.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.model.tokenizer import Tokenizer
from kvserve.tools.calls import calls_text
from kvserve.tools.rendering import Turn

_MARK = "\x00kvserve-answer-{}\x00"


@dataclass(frozen=True)
class GeneratedAnswer:
    text: str  # the answer's text, as the model wrote it
    token_ids: tuple[int, ...]  # its output ids (with the end-of-turn token if it produced one)


class CallTokens:
    """tenant, first call id -> the answer that made the call. Thread-safe (workers read, the loop writes)."""

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        self.max_tokens = max_tokens
        self._answers: OrderedDict[tuple[str, str], GeneratedAnswer] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()

    def remember(self, tenant: str, call_id: str, text: str, token_ids: Sequence[int]) -> None:
        answer = GeneratedAnswer(text, tuple(token_ids))
        with self._lock:
            old = self._answers.pop((tenant, call_id), None)
            self._num_tokens += len(answer.token_ids) - (len(old.token_ids) if old else 0)
            self._answers[(tenant, call_id)] = answer
            while self._num_tokens > self.max_tokens and self._answers:
                _, dropped = self._answers.popitem(last=False)
                self._num_tokens -= len(dropped.token_ids)

    def generated(self, tenant: str, turns: list[Turn]) -> dict[str, tuple[int, ...]]:
        """Rendered assistant content -> the ids generated for it, for each turn of `turns` that is an answer
        remembered here and unchanged."""
        found = {}
        with self._lock:
            for turn in turns:
                if turn.role != "assistant" or not turn.tool_calls:
                    continue
                answer = self._answers.get((tenant, turn.tool_calls[0].id))
                text = turn.content + calls_text(turn.tool_calls)
                if answer is not None and answer.text == text:
                    self._answers.move_to_end((tenant, turn.tool_calls[0].id))
                    found[text] = answer.token_ids
        return found


def encode_spliced(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   variables: dict[str, Any], generated: dict[str, tuple[int, ...]]) -> list[int] | None:
    """The prompt's ids with each generated answer's own ids in place of its text (None: nothing to splice)."""
    spliced, marked = [], []
    for message in messages:
        if message["role"] == "assistant" and message["content"] in generated:
            marked.append({**message, "content": _MARK.format(len(spliced))})
            spliced.append(generated[message["content"]])
        else:
            marked.append(message)
    if not spliced:
        return None
    text = tokenizer.apply_chat_template(marked, add_generation_prompt, **variables)
    ids: list[int] = []
    for n, answer in enumerate(spliced):
        before, _, text = text.partition(_MARK.format(n))
        piece = tokenizer.encode(before, add_special_tokens=False) if before else []
        if n and piece and ids and piece[0] == ids[-1]:  # the answer already ended its turn
            piece = piece[1:]
        ids += piece + list(answer)
    rest = tokenizer.encode(text, add_special_tokens=False) if text else []
    if rest and ids and rest[0] == ids[-1]:
        rest = rest[1:]
    return ids + rest
