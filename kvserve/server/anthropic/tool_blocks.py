"""Anthropic's blocks out of kvserve's tool layer: an output into `thinking` / `text` / `tool_use` blocks, whole or
streamed (content_block_start / thinking_delta + signature_delta / text_delta / input_json_delta /
content_block_stop). The request's blocks become a
conversation in conversation.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvserve.tools.parsing import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser


def output_blocks(text: str, parser: ToolCallParser) -> list[dict]:
    """The blocks of a whole output: its text (none when empty, as Anthropic answers an empty turn or a call
    cut before its name), then a tool_use block per call."""
    parsed = parser.parse(text)
    blocks = [{"type": "text", "text": parsed.content}] if parsed.content else []
    return blocks + [tool_use_block(call.id, call.name, call.arguments) for call in parsed.calls]


def tool_use_block(call_id: str, name: str, arguments: str | None) -> dict:
    """A `tool_use` block. A call cut by max_tokens (stop_reason "max_tokens") keeps its block with the input
    its arguments parse to, `{}` where they are not whole JSON yet: Anthropic's input is always an object
    (a stream's client reads the partial JSON itself from its input_json_delta events)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        value = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": value if isinstance(value, dict) else {}}


def thinking_block(thinking: str) -> dict:
    """A `thinking` block (kvserve signs nothing: its signature is empty, and a thinking block sent back is
    taken as it is)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


class BlockStream:
    """Content blocks opened as the output shows what they are, with their indexes. `parser` None: no tools,
    the answer is text."""

    def __init__(self, event: Callable[..., str], parser: ToolCallParser | None, first_index: int = 0) -> None:
        self._event = event
        self.parser = parser
        self._index = first_index - 1  # (a compaction block may come first)
        self._open: str | None = None  # "thinking" | "text" | "tool_use"

    @property
    def calls(self) -> list:
        return self.parser.calls if self.parser is not None else []

    def feed(self, text: str, finished: bool, thinking: str = "") -> list[str]:
        out: list[str] = []
        if thinking:
            if self._open != "thinking":
                out += self._start(thinking_block(""), "thinking")
            out.append(self._event("content_block_delta", index=self._index,
                                   delta={"type": "thinking_delta", "thinking": thinking}))
        if self.parser is None:
            events = [ContentDelta(text)] if text else []
        else:
            events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        for event in events:
            if isinstance(event, ContentDelta):
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""}, "text")
                out.append(self._event("content_block_delta", index=self._index,
                                       delta={"type": "text_delta", "text": event.text}))
            elif isinstance(event, CallStarted):
                out += self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}}, "tool_use")
            elif isinstance(event, ArgumentsDelta):
                out.append(self._event("content_block_delta", index=self._index,
                                       delta={"type": "input_json_delta", "partial_json": event.fragment}))
        if finished:
            out += self._stop()
        return out

    def _start(self, block: dict, kind: str) -> list[str]:
        out = self._stop()
        self._index += 1
        self._open = kind
        return out + [self._event("content_block_start", index=self._index, content_block=block)]

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        signature = [self._event("content_block_delta", index=self._index,
                                 delta={"type": "signature_delta", "signature": ""})] if self._open == "thinking" else []
        self._open = None
        return signature + [self._event("content_block_stop", index=self._index)]
