"""gpt-oss's harmony output split into thinking and answer, as it streams and whole.

After the generation prompt (`<|start|>assistant`) the model writes messages, each
`[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY` ended by `<|end|>`,
`<|return|>` or `<|call|>`:
- `analysis`: thinking;
- `final`, and `commentary` without a recipient (a preamble to the user): answer;
- `commentary to=functions.NAME`: a tool call, passed to the answer as written (header, body, `<|call|>`), where
  the HARMONY call layout (tools/layouts.py) reads it.
Output that does not open with a header is answer as written. Text that could still be a marker is held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.tools.parsing import held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>assistant", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")


@dataclass
class HarmonySplitter:
    _pending: str = ""
    _state: str = "header"  # header | body | plain
    _route: str = "answer"  # where the current body goes: thinking | answer | call

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        thinking: list[str] = []
        answer: list[str] = []
        while True:
            before = (self._state, len(self._pending))
            if self._state == "header":
                self._header(answer)
            elif self._state == "body":
                self._body(thinking, answer)
            else:
                answer.append(self._pending)
                self._pending = ""
            if (self._state, len(self._pending)) == before:
                return "".join(thinking), "".join(answer)

    def finish(self) -> tuple[str, str]:
        thinking, answer = self.feed("")
        rest, self._pending = self._pending, ""
        if self._state == "body" and self._route == "thinking":
            return thinking + rest, answer
        if self._state == "header" and rest.startswith((START, CHANNEL)):
            return thinking, answer  # a header cut short says nothing
        return thinking, answer + rest

    def _header(self, answer: list[str]) -> None:
        pending = self._pending
        head = pending[len(START):] if pending.startswith(START) else pending
        if not head.startswith(CHANNEL):
            if not (START.startswith(pending) or CHANNEL.startswith(head) or
                    (pending.startswith(START) and CHANNEL.startswith(head))):
                self._state = "plain"  # no header: the output is the answer as written
            return
        end = head.find(MESSAGE)
        if end < 0:
            return
        header = head[len(CHANNEL):end]
        channel, _, rest = header.partition(" ")
        recipient = next((word[3:] for word in rest.split() if word.startswith("to=")), None)
        if "to=" in channel:  # `<|channel|>commentary to=...` written without the space
            channel, recipient = channel.split("to=", 1)[0], channel.split("to=", 1)[1]
        if channel == "analysis":
            self._route = "thinking"
        elif channel == "commentary" and recipient is not None:
            self._route = "call"
            answer.append(head[:end + len(MESSAGE)])
        else:
            self._route = "answer"
        self._pending, self._state = head[end + len(MESSAGE):], "body"

    def _body(self, thinking: list[str], answer: list[str]) -> None:
        out = thinking if self._route == "thinking" else answer
        found = [(self._pending.find(end), end) for end in ENDS if end in self._pending]
        if not found:
            keep = max(held_back(self._pending, end) for end in ENDS)
            out.append(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return
        at, end = min(found)
        out.append(self._pending[:at])
        if self._route == "call":
            answer.append(end)
        self._pending, self._state = self._pending[at + len(end):], "header"
