"""Tool calls out of the output text, as it streams and whole (one parser, so both agree).

The layout is a CallLayout's (tools/layouts.py, HERMES unless told). Text before the first call (its
trigger, `<tool_call>`) is content; each call opens with its name (a `CallStarted`: id and name, what a
stream announces first), then its arguments in fragments, then closes. Whitespace, separators and the
list's close between and after calls are layout, not content. A trigger that does not go on as the layout
does (an unconstrained model's own idea of a call) stays text.

The arguments end where their JSON value ends (a scan of brackets and strings), not where the layout's
suffix is first seen: a call cut by max_tokens keeps exactly the argument text generated, never a piece of
the suffix (`}\\n</tool_call`), and the layout's suffix may itself be `}` (a bare JSON call). Text that
could still become the trigger, the suffix or the next call is held back until the next feed says which.

A call cut before its name is complete is dropped, never shown as content: after the trigger the output
is the grammar's. With `calls_only` (tool_choice required or a named function: the output is calls from
its first token), a trigger cut short is dropped too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvserve.tools.calls import ToolCall, new_call_id
from kvserve.tools.layouts import HERMES, CallLayout

# A function name as JSON, a string without raw newlines (the head of a call is one line), and what follows it.
_NAME = re.compile(r'("(?:[^"\\\n]|\\.)*")(.*)\Z', re.DOTALL)
# The start of one, not closed yet.
_OPEN_NAME = re.compile(r'(?:"(?:[^"\\\n]|\\.)*\\?)?\Z')
# A bare name (layouts with `quoted_name` False), and what follows it; its start may be empty.
_BARE_NAME = re.compile(r'([A-Za-z0-9_.\-]+)(.*)\Z', re.DOTALL)
_OPEN_BARE_NAME = re.compile(r'\Z')
_SCALAR = set("0123456789+-.eEtruefalsn")


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


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _JsonEnd:
    """Finds where one JSON value ends, fed in pieces: objects and arrays by their brackets, strings by their
    closing quote, scalars at the first character that cannot continue them."""

    depth: int = 0
    kind: str = ""  # "" before the first character | container | string | scalar
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value; -1: all of them, and it goes on."""
        for i, char in enumerate(text):
            if not self.kind:
                if char.isspace():
                    continue
                self.kind = "container" if char in "{[" else "string" if char == '"' else "scalar"
                if self.kind == "string":
                    self.in_string = True
                    continue
            if self.kind == "scalar":
                if char not in _SCALAR:
                    return i
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return i + 1
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1


@dataclass
class ToolCallParser:
    """Feed output text as it arrives; get content deltas and call events. `finish()` flushes."""

    id_prefix: str = "call_"
    layout: CallLayout = HERMES
    calls_only: bool = False  # the output was constrained to calls from its start
    _pending: str = ""
    _state: str = "text"  # text | head | args | suffix | between
    _head: str = ""  # the fixed text the current call's head starts with (after its trigger or marker)
    _marker: str = ""  # the trigger or marker that opened the current head (content if it is no call)
    _calls: list[ToolCall] = field(default_factory=list)
    _arguments: list[str] = field(default_factory=list)
    _json: _JsonEnd = field(default_factory=_JsonEnd)

    def feed(self, text: str) -> list[CallStarted | ArgumentsDelta | ContentDelta]:
        self._pending += text
        events: list[CallStarted | ArgumentsDelta | ContentDelta] = []
        while True:
            before = (self._state, len(self._pending))
            getattr(self, "_in_" + self._state)(events)
            if (self._state, len(self._pending)) == before:
                return events

    def finish(self) -> list[CallStarted | ArgumentsDelta | ContentDelta]:
        """The end of the output: what was held back goes out, or is dropped where it is layout or a call
        cut before its name. A call cut in its arguments keeps the argument text generated so far."""
        events = self.feed("")
        rest, self._pending = self._pending, ""
        if self._state == "text" and rest and not self.calls_only:
            events.append(ContentDelta(rest))  # a trigger's first characters, and no more
        elif self._state == "head":  # cut in a call's head: a call once its name is whole
            match = self._name_pattern()[0].match(rest[len(self._head):])
            # (a bare name is whole once what follows it has begun)
            if match is not None and (self.layout.quoted_name or match.group(2)):
                self._start_call(self._name(match.group(1)), events)
        elif self._state in ("args", "suffix"):
            self._close_call()
        elif self._state == "between":
            rest = rest[:len(rest) - held_back(rest, self.layout.next_marker)]  # a further call's first characters
            if not self.layout.is_layout_text(rest):
                events.append(ContentDelta(rest))
        self._state = "between" if self._calls else "text"
        return events

    def parse(self, text: str) -> ParsedOutput:
        """A whole output at once (a fresh parser's only feed)."""
        events = self.feed(text) + self.finish()
        return ParsedOutput("".join(e.text for e in events if isinstance(e, ContentDelta)), self.calls)

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    # --- states -------------------------------------------------------------------

    def _in_text(self, events: list) -> None:
        """Before the first call: content until the trigger."""
        trigger = self.layout.trigger
        start = self._pending.find(trigger)
        if start >= 0:
            self._emit_content(self._pending[:start], events)
            self._open_head(trigger, self.layout.first_head[len(trigger):], start + len(trigger))
            return
        keep = held_back(self._pending, trigger)
        self._emit_content(self._pending[:len(self._pending) - keep], events)
        self._pending = self._pending[len(self._pending) - keep:]

    def _in_between(self, events: list) -> None:
        """After a call: the layout's separator and the next call, or the end (text here waits for the end)."""
        marker = self.layout.next_marker
        start = self._pending.find(marker)
        if start >= 0:
            self._emit_content(self._pending[:start], events)
            self._open_head(marker, self.layout.next_head[len(marker):], start + len(marker))

    def _in_head(self, events: list) -> None:
        head, pending = self._head, self._pending
        if len(pending) < len(head):
            if not head.startswith(pending):
                self._not_a_call(events)
            return
        if not pending.startswith(head):
            self._not_a_call(events)
            return
        name_pattern, open_name = self._name_pattern()
        match = name_pattern.match(pending[len(head):])
        if match is None:  # the name is not closed yet, or is no JSON string
            if not open_name.match(pending[len(head):]):
                self._not_a_call(events)
            return
        name, after = match.group(1), match.group(2)
        prefix = self.layout.arguments_prefix
        if not after.startswith(prefix):
            if not prefix.startswith(after):
                self._not_a_call(events)
            return
        self._start_call(self._name(name), events)
        self._pending, self._state = after[len(prefix):], "args"

    def _in_args(self, events: list) -> None:
        if not self._pending:
            return
        end = self._json.scan(self._pending)
        taken = self._pending if end < 0 else self._pending[:end]
        if taken:
            self._arguments.append(taken)
            events.append(ArgumentsDelta(len(self._calls) - 1, taken))
        self._pending = "" if end < 0 else self._pending[end:]
        if end >= 0:
            self._state = "suffix"

    def _in_suffix(self, events: list) -> None:
        suffix = self.layout.suffix
        if self._pending.startswith(suffix) or not suffix.startswith(self._pending[:len(suffix)]):
            # (a mismatch is an unconstrained model's: the call ends with its arguments all the same)
            if self._pending.startswith(suffix):
                self._pending = self._pending[len(suffix):]
            self._close_call()
            self._state = "between"

    # --- helpers ------------------------------------------------------------------

    def _name_pattern(self) -> tuple[re.Pattern, re.Pattern]:
        """(a whole name and what follows it, the start of one) in this layout."""
        return (_NAME, _OPEN_NAME) if self.layout.quoted_name else (_BARE_NAME, _OPEN_BARE_NAME)

    def _name(self, text: str) -> str:
        return json.loads(text) if self.layout.quoted_name else text

    def _open_head(self, marker: str, head: str, end: int) -> None:
        self._marker, self._head = marker, head
        self._pending, self._state = self._pending[end:], "head"

    def _not_a_call(self, events: list) -> None:
        """The text after a trigger is not a call in this layout: the trigger was text."""
        self._emit_content(self._marker, events)
        self._state = "between" if self._calls else "text"

    def _start_call(self, name: str, events: list) -> None:
        index = len(self._calls)
        self._calls.append(ToolCall(new_call_id(self.id_prefix), name, ""))
        self._arguments, self._json = [], _JsonEnd()
        events.append(CallStarted(index, self._calls[-1].id, name))

    def _emit_content(self, text: str, events: list) -> None:
        if text and (not self._calls or not self.layout.is_layout_text(text)):
            events.append(ContentDelta(text))

    def _close_call(self) -> None:
        call = self._calls[-1]
        self._calls[-1] = ToolCall(call.id, call.name, "".join(self._arguments))


def parse_output(text: str, id_prefix: str = "call_", layout: CallLayout = HERMES,
                 calls_only: bool = False) -> ParsedOutput:
    """The content and calls of a whole output."""
    return ToolCallParser(id_prefix, layout, calls_only).parse(text)
