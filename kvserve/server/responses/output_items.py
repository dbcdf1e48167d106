"""The output items of a response whose output may hold thinking or function calls: a `reasoning` item for a
reasoning model's thinking, a `message` item for text, a `function_call` item per call, in output order, with
their stream events (output_item.added, reasoning_text.delta / .done, output_text.delta,
function_call_arguments.delta / .done, output_item.done ...). One parser feeds both the stream and the final
body, so the ids a client saw streamed are the ids in the Response."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from kvserve.tools.parsing import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser


class OutputItems:
    def __init__(self, event: Callable[..., str], parser: ToolCallParser | None, first_index: int = 0) -> None:
        self._event = event  # (type, **fields) -> an SSE event with its sequence number
        self.first_index = first_index  # of the first item in the Response's output (after a compaction item)
        self.parser = parser
        self.items: list[dict] = []  # each {"item": the item as it stands, "text": [...] for a message}
        self._open: dict | None = None
        self.finished = False

    def feed(self, text: str, finished: bool, status: str = "completed", thinking: str = "") -> list[str]:
        """Events for `thinking` and the answer's `text` (and the end of the output when `finished`, the last item
        closing with `status`: "incomplete" where max_output_tokens cut it, a function call's arguments
        included). `parser` None: no tools, the answer is text."""
        if self.parser is None:
            events: list = [ContentDelta(text)] if text else []
        else:
            events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        self.finished = self.finished or finished
        out: list[str] = self._think(thinking) if thinking else []
        for event in events:
            if isinstance(event, ContentDelta):
                if self._open is None or self._open["item"]["type"] != "message":
                    out += self._close() + self._open_message()
                self._open["text"].append(event.text)
                out.append(self._event("response.output_text.delta", item_id=self._open["item"]["id"],
                                       output_index=self._index(), content_index=0, delta=event.text, logprobs=[]))
            elif isinstance(event, CallStarted):
                out += self._close()
                self._open = {"item": {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                                       "call_id": event.id, "name": event.name, "arguments": "",
                                       "status": "in_progress"}, "call": event.index}
                self.items.append(self._open)
                out.append(self._event("response.output_item.added", output_index=self._index(),
                                       item=self._open["item"]))
            elif isinstance(event, ArgumentsDelta):
                out.append(self._event("response.function_call_arguments.delta", item_id=self._open["item"]["id"],
                                       output_index=self._index(), delta=event.fragment))
        if finished:
            out += self._close(status)
        return out

    def final(self, status: str) -> list[dict]:
        """The items of the Response object (`status` of the last item: completed or incomplete)."""
        return [self._finished_item(entry, status if n == len(self.items) - 1 else "completed")
                for n, entry in enumerate(self.items)]

    @property
    def calls(self) -> list:
        return self.parser.calls if self.parser is not None else []

    def _think(self, thinking: str) -> list[str]:
        out: list[str] = []
        if self._open is None or self._open["item"]["type"] != "reasoning":
            out += self._close()
            self._open = {"item": {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                                   "content": [], "status": "in_progress"}, "text": []}
            self.items.append(self._open)
            out += [self._event("response.output_item.added", output_index=self._index(), item=self._open["item"]),
                    self._event("response.content_part.added", item_id=self._open["item"]["id"],
                                output_index=self._index(), content_index=0,
                                part={"type": "reasoning_text", "text": ""})]
        self._open["text"].append(thinking)
        out.append(self._event("response.reasoning_text.delta", item_id=self._open["item"]["id"],
                               output_index=self._index(), content_index=0, delta=thinking))
        return out

    def _index(self) -> int:
        return self.first_index + len(self.items) - 1

    def _open_message(self) -> list[str]:
        self._open = {"item": {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                               "role": "assistant", "content": []}, "text": []}
        self.items.append(self._open)
        return [self._event("response.output_item.added", output_index=self._index(), item=self._open["item"]),
                self._event("response.content_part.added", item_id=self._open["item"]["id"],
                            output_index=self._index(), content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _close(self, status: str = "completed") -> list[str]:
        entry, self._open = self._open, None
        if entry is None:
            return []
        index = self.first_index + self.items.index(entry)
        item = self._finished_item(entry, status)
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        if item["type"] == "message":
            text = item["content"][0]["text"]
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _finished_item(self, entry: dict, status: str) -> dict:
        item = dict(entry["item"], status=status)
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": "".join(entry["text"])}]
        elif item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": "".join(entry["text"]), "annotations": [],
                                "logprobs": []}]
        else:
            item["arguments"] = self.parser.calls[entry["call"]].arguments
        return item
