"""A reasoning model's thinking out of its output text, as it streams and whole: `<think>` ... `</think>`
(Qwen3, SmolLM3, DeepSeek-R1 style). Text before `</think>` (after an optional opening `<think>`, which
some templates write into the generation prompt instead) is thinking; the rest is the answer. Text that
could still become a tag is held back until the next feed says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.tools.parsing import held_back

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_supports_thinking(template: str | None) -> bool:
    """A chat template that knows thinking switches it (`enable_thinking`) or writes the tags itself."""
    return bool(template) and ("enable_thinking" in template or THINK_OPEN in template)


@dataclass
class ThinkingSplitter:
    """Feed output text; get (thinking, answer) deltas; `finish()` flushes what was held back. Newlines
    around the tags are layout, dropped whether the text comes whole or in pieces. `opened`: the prompt
    already ended with `<think>` (the template opened the thinking), so the output starts inside it."""

    opened: bool = False
    _pending: str = ""
    _state: str = ""  # start (an opening tag may come) | thinking | answer
    _strip: bool = True  # leading newlines of the current part are still being dropped

    def __post_init__(self) -> None:
        self._state = "thinking" if self.opened else "start"

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        thinking = ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._pending, self._state = stripped[len(THINK_OPEN):], "thinking"
            elif THINK_OPEN.startswith(stripped):
                return "", ""  # may still become the opening tag
            else:
                self._state, self._strip = "answer", False  # no thinking: the output is the answer as written
        if self._state == "thinking":
            if not self._lstrip():
                return "", ""
            end = self._pending.find(THINK_CLOSE)
            if end < 0:  # hold back what may be the closing tag, and newlines that may precede it
                keep = held_back(self._pending, THINK_CLOSE)
                body = self._pending[:len(self._pending) - keep]
                emit = body.rstrip("\n")
                self._pending = self._pending[len(emit):]
                return emit, ""
            thinking = self._pending[:end].rstrip("\n")
            self._pending, self._state, self._strip = self._pending[end + len(THINK_CLOSE):], "answer", True
        if not self._lstrip():
            return thinking, ""
        answer, self._pending = self._pending, ""
        return thinking, answer

    def _lstrip(self) -> bool:
        """Drop the current part's leading newlines; False while nothing else has come yet."""
        if self._strip:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return False
            self._strip = False
        return True

    def finish(self) -> tuple[str, str]:
        """The end of the output: an unclosed thinking is thinking."""
        rest, self._pending = self._pending, ""
        if self._state == "thinking":
            return rest.strip("\n"), ""
        return "", rest.lstrip("\n") if self._strip else rest


def split_thinking(text: str, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a whole output."""
    splitter = ThinkingSplitter(opened)
    thinking, answer = splitter.feed(text)
    more_thinking, more_answer = splitter.finish()
    return thinking + more_thinking, answer + more_answer
