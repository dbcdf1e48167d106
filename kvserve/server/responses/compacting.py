"""Compaction on the Responses API: `POST /v1/responses/compact`, and `context_management` compaction on create.

The history to fold is what the request continues: a stored response's exact token ids (previous_response_id)
and/or the input items, after the last compaction item (whose summary they then continue). The compaction
pass's prompt is that history as the turn would have sent it, then kvserve's summarizing request
(server/compaction/summary.py), so the pass hits the history's cached blocks. A pass that would not fit the
context drops the oldest turns first (they are lost to the summary, as `truncation: auto` loses them).
"""

from __future__ import annotations

import time
import uuid

from kvserve.server.compaction.summarizer import Summarizer, SummaryPass
from kvserve.server.compaction.summary import summary_turns
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.prompt.builder import PromptBuilder
from kvserve.server.prompt.segments import TurnSegments
from kvserve.server.responses.protocol import ResponsesRequest, last_compaction
from kvserve.server.responses.store import ResponsesStore, StoredResponse
from kvserve.tools.rendering import Turn

_MAX_CHAIN = 10_000  # previous_response_id links followed for the user messages of a compacted history


class ResponsesCompaction:
    def __init__(self, summarizer: Summarizer, store: ResponsesStore) -> None:
        self.summarizer = summarizer
        self.store = store

    @property
    def builder(self) -> PromptBuilder:
        return self.summarizer.serving.prompts

    def summary_of(self, body: ResponsesRequest, previous: StoredResponse | None, tenant: str) -> str | None:
        """The summary the request continues: its last compaction item's (a 400 unless this server sealed it
        for this tenant), else the stored response's."""
        sealed, _ = last_compaction(body.input)
        if sealed is not None:
            return self.summarizer.open(sealed, tenant)
        return previous.summary if previous is not None else None

    # --- the pass's prompt (worker) ----------------------------------------------

    def pass_prompt(self, body: ResponsesRequest, previous: StoredResponse | None, tool_use: ToolUse, tenant: str,
                    summary: str | None, keep_new_turn: bool, segments: TurnSegments
                    ) -> tuple[list[int], list[Turn]] | None:
        """(the compaction pass's prompt, the turns left to answer after it), or None with no history to fold.
        `keep_new_turn` (create): the input's last user turn onward is answered, not folded."""
        earlier = {item["call_id"]: item["name"] for item in (previous.body["output"] if previous else [])
                   if item["type"] == "function_call"}
        turns = body.turns(earlier)
        if previous is None:
            split = max((n for n, turn in enumerate(turns) if turn.role == "user"), default=0) if keep_new_turn \
                else len(turns)
            history, new = turns[:split], turns[split:]
            if not history:
                return None
            while True:
                prompt = self.builder.build(body.to_conversation(tool_use, tenant, earlier, summary,
                                                                 summary_turns(history))).token_ids
                if self.summarizer.fits(len(prompt)) or len(history) == 1:
                    return prompt, new
                history = history[1:]
        folded, new = ([], turns) if keep_new_turn else (turns, [])
        conversation = body.to_conversation(tool_use, tenant, earlier, summary, summary_turns(folded))
        head = self.builder.instruction_messages(conversation)
        messages, variables = self.builder.messages(conversation)
        instruction_ids = segments.instructions(head[0]["content"] if head else None, variables)
        stored = list(previous.turns)
        stored[-1] = stored[-1] + tuple(segments.close_answer(stored[-1]))
        tail = segments.next_turn(messages[len(head):], variables)
        while len(stored) > 1 and not self.summarizer.fits(len(instruction_ids) + sum(map(len, stored)) + len(tail)):
            stored.pop(0)
        return [t for segment in (instruction_ids, *stored, tail) for t in segment], new

    # --- POST /v1/responses/compact --------------------------------------------------

    def user_messages(self, body: ResponsesRequest, previous: StoredResponse | None, tenant: str) -> list[dict]:
        """Every user message of the history, oldest first (the stored chain's, then the input's), with ids."""
        chain: list[StoredResponse] = []
        while previous is not None and len(chain) < _MAX_CHAIN:
            chain.append(previous)
            link = previous.body.get("previous_response_id")
            previous = self.store.get(link, tenant) if link else None
        items = [item for entry in reversed(chain) for item in entry.input_items]
        items += [{"id": f"msg_{uuid.uuid4().hex}", **item} for item in body.input_items()]
        return [{**item, "status": "completed"} for item in items
                if item.get("type") == "message" and item.get("role") == "user"]

    def compacted(self, messages: list[dict], done: SummaryPass) -> dict:
        """The `response.compaction` object: the user messages, then the one compaction item."""
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response.compaction", "created_at": int(time.time()),
                "output": [*messages, done.item], "usage": pass_usage(done)}


def pass_usage(done: SummaryPass) -> dict:
    """A compaction pass's usage in the Responses API's shape."""
    return {"input_tokens": done.num_prompt_tokens, "input_tokens_details": {"cached_tokens": done.num_cached_tokens},
            "output_tokens": done.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.num_prompt_tokens + done.num_output_tokens}
