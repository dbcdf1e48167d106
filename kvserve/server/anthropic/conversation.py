"""A Messages request's blocks into the prompt builder's conversation: `tool_use` / `tool_result` blocks as
calls and results, and a mark after each block that carries `cache_control` (and after the tool
definitions when one of them does), tagged with its TTL, so the builder can say where each breakpoint
falls in tokens."""

from __future__ import annotations

from kvserve.server.anthropic.protocol import Message, MessagesPrompt
from kvserve.server.compaction.summary import compacted_instructions
from kvserve.server.core.tool_use import ToolUse, link_tool_results
from kvserve.server.prompt.builder import Conversation
from kvserve.tools.calls import ToolCall, dumps
from kvserve.tools.rendering import Turn


def after_compaction(messages: list[Message]) -> tuple[str | None, list[Message]]:
    """(the summary of the last compaction block with content, the messages from it on without it and the
    blocks before it): a compaction block stands for everything before it, as Anthropic drops it."""
    for n in range(len(messages) - 1, -1, -1):
        blocks = messages[n].blocks()
        for k in range(len(blocks) - 1, -1, -1):
            if blocks[k].type == "compaction" and isinstance(blocks[k].content, str):
                rest = [Message(role=messages[n].role, content=blocks[k + 1:])] if blocks[k + 1:] else []
                return blocks[k].content, rest + list(messages[n + 1:])
    return None, list(messages)


def messages_conversation(body: MessagesPrompt, tool_use: ToolUse, tenant: str | None,
                          variables: dict | None = None) -> Conversation:
    """The conversation; each mark's tag is its breakpoint's TTL in seconds (`variables`: more template variables,
    the thinking switch). A compacted history is the system prompt, then the summary
    (server/compaction/summary.py), then the messages after the compaction."""

    def add_text(turn: Turn, text: str, cache_control) -> None:
        turn.content += text
        if cache_control is not None:
            turn.marks.append((len(turn.content), cache_control.ttl_s))

    turns: list[Turn] = []
    system = Turn("system")
    for block in body.system_blocks():
        add_text(system, block.text, block.cache_control)
    summary, messages = after_compaction(body.messages)
    system.content = compacted_instructions(system.content or None, summary) or ""
    if system.content:
        turns.append(system)
    for message in messages:
        for block in message.blocks():
            if block.type == "compaction":  # a failed one (no content): a no-op, as Anthropic
                continue
            if block.type == "tool_result":
                turns.append(Turn("tool", tool_call_id=block.tool_use_id))
                add_text(turns[-1], block.result_text(), block.cache_control)
                continue
            if not turns or turns[-1].role != message.role:
                turns.append(Turn(message.role))
            if block.type == "text":
                add_text(turns[-1], block.text, block.cache_control)
            elif block.type == "thinking":  # an earlier answer's thinking (templates that keep it render it)
                turns[-1].reasoning += block.thinking
            elif block.type == "redacted_thinking":
                continue
            else:  # a tool_use: its input written as the call grammar writes arguments
                turns[-1].tool_calls.append(ToolCall(block.id, block.name, dumps(block.input)))
    link_tool_results(turns)
    tool_ttls = [tool.cache_control.ttl_s for tool in body.tools or [] if tool.cache_control is not None]
    # one breakpoint after the definitions, the longest TTL
    return Conversation(turns, tool_use.tools, tenant=tenant, tools_mark=max(tool_ttls) if tool_ttls else None,
                        variables=dict(variables or {}))
