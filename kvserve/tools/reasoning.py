"""A reasoning model's thinking out of its output text, as it streams and whole, in its family's format:

- THINK_TAGS: `<think>` ... `</think>` (Qwen3, SmolLM3, DeepSeek-R1 style), switched by the template variable
  `enable_thinking` (SmolLM3's template also reads `/think` and `/no_think` in the system message);
- MISTRAL_THINK: `[THINK]` ... `[/THINK]` (Ministral 3 Reasoning; its template has no switch);
- HARMONY: gpt-oss's channels, `<|channel|>analysis<|message|>` ... `<|end|>` (tools/harmony.py), its depth
  the template variable `reasoning_effort` (low / medium / high).

Text before the closing tag (after an optional opening tag, which some templates write into the generation
prompt instead) is thinking; the rest is the answer. Text that could still become a tag is held back until the
next feed says which. The answer is what the tool parser reads, so a call written inside the thinking is
never a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.tools.parsing import held_back

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family marks its thinking. `opener` / `closer`: the tags (HARMONY: the analysis channel's header and
    end); `switch`: the template variable that turns it on and off (or sets its depth), "" if none."""

    name: str
    opener: str
    closer: str
    switch: str = ""
    # The text after which the rest of the output is the answer, where structured output and tool grammars start
    # (vLLM applies them after the reasoning the same way).
    answer_start: str = ""

    def parser(self, opened: bool = False) -> "ReasoningParser":
        if self is HARMONY:
            from kvserve.tools.harmony import HarmonySplitter

            return HarmonySplitter()
        return ThinkingSplitter(opened, self.opener, self.closer)

    def variables(self, enabled: bool | None, effort: str | None = None) -> dict[str, Any]:
        """The template variables of a request's switch (`enabled` None and no `effort`: the template's default)."""
        if self.switch == "enable_thinking" and enabled is not None:
            return {"enable_thinking": enabled}
        if self.switch == "reasoning_effort" and (effort is not None or enabled is not None):
            # (harmony cannot turn thinking off: the least there is, is "low")
            return {"reasoning_effort": effort if effort is not None else "medium" if enabled else "low"}
        return {}

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` already opened the thinking (the output starts inside it)."""
        return self is not HARMONY and prompt_tail.rstrip().endswith(self.opener)


THINK_TAGS = ReasoningFormat("think", THINK_OPEN, THINK_CLOSE, "enable_thinking", THINK_CLOSE)
MISTRAL_THINK = ReasoningFormat("mistral_think", "[THINK]", "[/THINK]", "", "[/THINK]")
HARMONY = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>", "reasoning_effort",
                          "<|start|>assistant")


def reasoning_for_template(template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template knows (None: it knows none; its output is all answer)."""
    if not template:
        return None
    if "<|channel|>" in template:
        return HARMONY
    if "[THINK]" in template:
        return MISTRAL_THINK
    if "enable_thinking" in template or THINK_OPEN in template:
        return THINK_TAGS
    return None


def template_supports_thinking(template: str | None) -> bool:
    """A chat template that knows thinking (switches it, or writes its tags itself)."""
    return reasoning_for_template(template) is not None


class ReasoningParser(Protocol):
    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) deltas of more output text."""

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back."""


@dataclass
class ThinkingSplitter:
    """Feed output text; get (thinking, answer) deltas; `finish()` flushes what was held back. Newlines
    around the tags are layout, dropped whether the text comes whole or in pieces. `opened`: the prompt
    already ended with the opening tag (the template opened the thinking), so the output starts inside it."""

    opened: bool = False
    opener: str = THINK_OPEN
    closer: str = THINK_CLOSE
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
            if stripped.startswith(self.opener):
                self._pending, self._state = stripped[len(self.opener):], "thinking"
            elif self.opener.startswith(stripped):
                return "", ""  # may still become the opening tag
            else:
                self._state, self._strip = "answer", False  # no thinking: the output is the answer as written
        if self._state == "thinking":
            if not self._lstrip():
                return "", ""
            end = self._pending.find(self.closer)
            if end < 0:  # hold back what may be the closing tag, and newlines that may precede it
                keep = held_back(self._pending, self.closer)
                body = self._pending[:len(self._pending) - keep]
                emit = body.rstrip("\n")
                self._pending = self._pending[len(emit):]
                return emit, ""
            thinking = self._pending[:end].rstrip("\n")
            self._pending, self._state, self._strip = self._pending[end + len(self.closer):], "answer", True
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


def split_thinking(text: str, opened: bool = False, reasoning: ReasoningFormat = THINK_TAGS) -> tuple[str, str]:
    """(thinking, answer) of a whole output."""
    parser = reasoning.parser(opened)
    thinking, answer = parser.feed(text)
    more_thinking, more_answer = parser.finish()
    return thinking + more_thinking, answer + more_answer
