"""Tool calls out of the output text, as it streams and whole (one parser, so both agree).

The layout is tools/calls.py's. Text before the first `<tool_call>` is content; each call opens with its
name (a `CallStarted`: id and name, what a stream announces first), then its arguments in fragments,
then closes. Whitespace between and after calls is layout, not content. A `<tool_call>` that does not
go on as the layout does (an unconstrained model's own idea of a call) stays text. Text that could
still become `<tool_call>` or the end of a call is held back until the next feed says which.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvserve.tools.calls import ARGUMENTS_PREFIX, CALL_OPEN, CALL_SUFFIX, NAME_PREFIX, ToolCall, new_call_id

_HEAD = re.compile(re.escape(NAME_PREFIX) + r'("(?:[^"\\\n]|\\.)*")' + re.escape(ARGUMENTS_PREFIX))


@dataclass
class CallStarted:
    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    fragment: str


@dataclass
class ContentDelta:
    text: str


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """Feed output text as it arrives; get content deltas and call events. `finish()` flushes."""

    id_prefix: str = "call_"
    _pending: str = ""
    _state: str = "text"  # text | head | args
    _calls: list[ToolCall] = field(default_factory=list)
    _arguments: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[CallStarted | ArgumentsDelta | ContentDelta]:
        self._pending += text
        events: list[CallStarted | ArgumentsDelta | ContentDelta] = []
        while True:
            before = (self._state, len(self._pending))
            getattr(self, "_" + self._state)(events)
            if (self._state, len(self._pending)) == before:
                return events

    def finish(self) -> list[CallStarted | ArgumentsDelta | ContentDelta]:
        """The end of the output: what was held back goes out (an unfinished call's arguments as they are)."""
        events = self.feed("")
        rest, self._pending = self._pending, ""
        if self._state == "args":
            self._arguments.append(rest)
            events.append(ArgumentsDelta(len(self._calls) - 1, rest))
            self._close_call()
        elif self._state == "head":  # after calls, a further call cut off before its name is dropped
            if not self._calls:
                events.append(ContentDelta(CALL_OPEN + rest))
        elif rest and (not self._calls or rest.strip()):
            events.append(ContentDelta(rest))
        self._state = "text"
        return events

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def _text(self, events: list) -> None:
        start = self._pending.find(CALL_OPEN)
        if start >= 0:
            self._emit_content(self._pending[:start], events)
            self._pending, self._state = self._pending[start + len(CALL_OPEN):], "head"
            return
        keep = _held_back(self._pending, CALL_OPEN)
        if not self._calls:  # after a call, text waits: it may be the separator before the next one
            self._emit_content(self._pending[:len(self._pending) - keep], events)
            self._pending = self._pending[len(self._pending) - keep:]

    def _emit_content(self, text: str, events: list) -> None:
        if text and (not self._calls or text.strip()):
            events.append(ContentDelta(text))

    def _head(self, events: list) -> None:
        match = _HEAD.match(self._pending)
        if match is None:
            if not NAME_PREFIX.startswith(self._pending[:len(NAME_PREFIX)]) or "\n" in self._pending[1:]:
                # not a call in this layout: it was text
                events.append(ContentDelta(CALL_OPEN))
                self._state = "text"
            return
        index = len(self._calls)
        self._calls.append(ToolCall(new_call_id(self.id_prefix), json.loads(match.group(1)), ""))
        self._arguments = []
        events.append(CallStarted(index, self._calls[-1].id, self._calls[-1].name))
        self._pending, self._state = self._pending[match.end():], "args"

    def _args(self, events: list) -> None:
        end = self._pending.find(CALL_SUFFIX)
        cut = end if end >= 0 else len(self._pending) - _held_back(self._pending, CALL_SUFFIX)
        if cut > 0:
            self._arguments.append(self._pending[:cut])
            events.append(ArgumentsDelta(len(self._calls) - 1, self._pending[:cut]))
        if end >= 0:
            self._pending = self._pending[end + len(CALL_SUFFIX):]
            self._close_call()
            self._state = "text"
        else:
            self._pending = self._pending[cut:]

    def _close_call(self) -> None:
        call = self._calls[-1]
        self._calls[-1] = ToolCall(call.id, call.name, "".join(self._arguments))


def parse_output(text: str, id_prefix: str = "call_") -> ParsedOutput:
    """The content and calls of a whole output."""
    parser = ToolCallParser(id_prefix)
    events = parser.feed(text) + parser.finish()
    return ParsedOutput("".join(e.text for e in events if isinstance(e, ContentDelta)), parser.calls)
