"""Anthropic's `context_management` edits (beta): clearing old tool results, and compaction.

Each edit needs its beta, as Anthropic's API: `anthropic-beta: context-management-2025-06-27` for
`clear_tool_uses_20250919`, `compact-2026-01-12` for `compact_20260112` (the SDK's `betas=[...]` sends it).

- clear_tool_uses_20250919: once the prompt passes `trigger` (input tokens, default 100,000; or a count of
  tool uses), the results of all but the last `keep` tool uses (default 3) become `CLEARED` (and their
  inputs `{}` with `clear_tool_inputs`), tools named in `exclude_tools` kept; not applied when it would
  clear fewer than `clear_at_least` tokens. Reported in `context_management.applied_edits`.
- compact_20260112: once the prompt passes `trigger` (default 150,000 input tokens), the model summarizes the
  whole conversation (server/compaction/: kvserve's request, or the edit's `instructions`), the answer's
  prompt is the system prompt + the summary + the last user turn, and the response leads with a
  `compaction` block holding the summary. A later request that sends that block back (in an assistant
  message) drops every block before it and renders the same system prompt + summary: a cached prefix.
"""

from __future__ import annotations

from kvserve.errors import InvalidRequestError
from kvserve.server.anthropic.conversation import after_compaction, messages_conversation
from kvserve.server.anthropic.protocol import ContentBlock, ContextEdit, Message, MessagesRequest
from kvserve.server.compaction.summary import summary_turns
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.prompt.builder import PromptBuilder

CLEAR_BETA = "context-management-2025-06-27"
COMPACT_BETA = "compact-2026-01-12"
_BETAS = {"clear_tool_uses_20250919": CLEAR_BETA, "compact_20260112": COMPACT_BETA}
CLEAR_TRIGGER_TOKENS = 100_000  # Anthropic's defaults
COMPACT_TRIGGER_TOKENS = 150_000
KEEP_TOOL_USES = 3
CLEARED = "[tool result cleared to save context]"


def check_betas(edits: list[ContextEdit], header: str | None) -> None:
    """Each edit's beta must be in the `anthropic-beta` header (a 400 naming it, as Anthropic's)."""
    sent = {beta.strip() for beta in (header or "").split(",")}
    for edit in edits:
        if _BETAS[edit.type] not in sent:
            raise InvalidRequestError(f"context_management edit {edit.type} needs the beta header "
                                      f"'anthropic-beta: {_BETAS[edit.type]}'", param="context_management")


def _edit(body: MessagesRequest, kind: str) -> ContextEdit | None:
    edits = body.context_management.edits if body.context_management is not None else []
    return next((edit for edit in edits if edit.type == kind), None)


class ContextEdits:
    """(worker methods) The edits over a request's messages, built and counted by the one prompt builder."""

    def __init__(self, builder: PromptBuilder) -> None:
        self.builder = builder

    def count(self, body: MessagesRequest, tool_use: ToolUse, tenant: str) -> int:
        return len(self.builder.build(messages_conversation(body, tool_use, tenant)).token_ids)

    def clear_tool_uses(self, body: MessagesRequest, tool_use: ToolUse, tenant: str
                        ) -> tuple[MessagesRequest, list[dict]]:
        """(the request with old tool results cleared, the applied edit's report) when the edit fires."""
        edit = _edit(body, "clear_tool_uses_20250919")
        if edit is None:
            return body, []
        _, live = after_compaction(body.messages)
        uses = [block for message in live for block in message.blocks() if block.type == "tool_use"]
        before = self.count(body, tool_use, tenant)
        trigger = edit.trigger
        fired = len(uses) > trigger.value if trigger is not None and trigger.type == "tool_uses" else \
            before > (trigger.value if trigger is not None else CLEAR_TRIGGER_TOKENS)
        keep = edit.keep.value if edit.keep is not None else KEEP_TOOL_USES
        excluded = set(edit.exclude_tools or [])
        names = {block.id: block.name for block in uses}
        old = {block.id for block in uses[:max(len(uses) - keep, 0)] if block.name not in excluded}
        if not fired or not old:
            return body, []
        inputs = edit.clear_tool_inputs
        messages = []
        for message in body.messages:
            blocks = []
            for block in message.blocks():
                if block.type == "tool_result" and block.tool_use_id in old and block.result_text() != CLEARED:
                    block = block.model_copy(update={"content": CLEARED})
                elif block.type == "tool_use" and block.id in old and (inputs is True or (
                        isinstance(inputs, list) and names[block.id] in inputs)):
                    block = block.model_copy(update={"input": {}})
                blocks.append(block)
            messages.append(Message(role=message.role, content=blocks))
        cleared = body.model_copy(update={"messages": messages})
        saved = before - self.count(cleared, tool_use, tenant)
        if edit.clear_at_least is not None and saved < edit.clear_at_least.value:
            return body, []
        return cleared, [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": len(old),
                          "cleared_input_tokens": max(saved, 0)}]

    def compaction_due(self, body: MessagesRequest, tool_use: ToolUse, tenant: str) -> ContextEdit | None:
        """The compaction edit when the prompt passes its trigger."""
        edit = _edit(body, "compact_20260112")
        if edit is None:
            return None
        trigger = edit.trigger.value if edit.trigger is not None else COMPACT_TRIGGER_TOKENS
        return edit if self.count(body, tool_use, tenant) > trigger else None

    def pass_prompt(self, body: MessagesRequest, tool_use: ToolUse, tenant: str, edit: ContextEdit) -> list[int]:
        """The compaction pass: the conversation as this turn renders it, then the summarizing request."""
        conversation = messages_conversation(body, tool_use, tenant)
        conversation.turns = summary_turns(conversation.turns, edit.instructions)
        return self.builder.build(conversation).token_ids

    @staticmethod
    def compacted(body: MessagesRequest, summary: str) -> MessagesRequest:
        """The request as the answer runs after compaction: a compaction block, then the last user turn (from
        the tool_use its tool results answer, when they do)."""
        _, messages = after_compaction(body.messages)
        start = max(n for n, message in enumerate(messages) if message.role == "user")
        if start > 0 and any(block.type == "tool_result" for block in messages[start].blocks()):
            start -= 1
        block = ContentBlock(type="compaction", content=summary)
        head = messages[start]
        kept = [Message(role="assistant", content=[block])] + messages[start:] if head.role == "user" else \
            [Message(role="assistant", content=[block, *head.blocks()])] + messages[start + 1:]
        return body.model_copy(update={"messages": kept})
