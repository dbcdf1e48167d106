"""Why a resent agent conversation left the cache where it did, guessed from the text at the divergence.

The usual causes in an agent loop (the mission's "accidental nondeterminism"): the tool definitions
changed (a tool added, dropped, reordered, or its schema re-serialized with other key order or
spacing), a tool call in the history was re-serialized differently from how the model wrote it, or a
timestamp in the system prompt moved on. The divergence's position says which: inside the `<tools>`
block, inside a `<tool_call>`, or on a date or time. The prefix report (engine/output/prefix_report.py)
adds the cause to its reason.
"""

from __future__ import annotations

import re

from kvserve.tools.calls import CALL_CLOSE, CALL_OPEN

# Text before the divergence worth reading: enough to find the tags that enclose it.
CONTEXT_TOKENS = 4096
_TOOLS_OPEN, _TOOLS_CLOSE = "<tools>", "</tools>"
# A date or a clock time the divergence falls in: 2026-11-25, 25/11/2026, 14:03, 14:03:59.
_TIME = re.compile(r"\d{4}-\d{1,2}-\d{1,2}|\d{1,2}/\d{1,2}/\d{2,4}|\d{1,2}:\d{2}(:\d{2})?")


def _inside(before: str, open_tag: str, close_tag: str) -> bool:
    return before.rfind(open_tag) > before.rfind(close_tag)


def divergence_cause(before: str, ours: str, theirs: str) -> str | None:
    """The likely cause, given the text before the divergence and how each prompt goes on (None: no guess)."""
    if _inside(before, _TOOLS_OPEN, _TOOLS_CLOSE):
        return "the tool definitions changed (a tool added, removed, reordered or its schema written differently)"
    if _inside(before, CALL_OPEN, CALL_CLOSE):
        return ("a tool call in the history was written differently from how the model generated it (send "
                "the call's arguments back exactly as received)")
    tail = before[-24:]
    for continuation in (ours, theirs):
        for match in _TIME.finditer(tail + continuation[:24]):
            if match.start() <= len(tail) < match.end():  # the time spans the divergence
                return "a date or time in the prompt changed (a timestamp in a system prompt misses every turn)"
    return None
