"""The summarizing prompt kvserve owns, and how a compacted history renders.

The compaction pass is the conversation itself (instructions, any earlier summary, every turn) followed by
one user turn, `SUMMARY_REQUEST`: so the pass reuses the blocks the conversation already cached, and the
model writes the summary in the conversation's own context. Greedy, at most `SUMMARY_MAX_TOKENS`.

A compacted history renders as one system message: the instructions, then `SUMMARY_HEADER` and the
summary (`compacted_instructions`); then the turns that came after the compaction. The system message is
the prompt builder's instructions segment (Conversation.split_instructions), so every later turn starts with
the same tokens for it and hits its blocks; folding the summary into the system message keeps the roles
alternating for templates that require it.
"""

from __future__ import annotations

from kvserve.tools.rendering import Turn

SUMMARY_REQUEST = ("Summarize the conversation so far for a reader who will see only the summary. Keep every "
                   "fact, name, number and decision. Plain sentences, no preamble.")
SUMMARY_HEADER = "Summary of the earlier conversation:"
SUMMARY_MAX_TOKENS = 384


def compacted_instructions(instructions: str | None, summary: str | None) -> str | None:
    """The system message of a compacted history: the instructions, then the summary."""
    if summary is None:
        return instructions
    block = f"{SUMMARY_HEADER}\n{summary.strip()}"
    return f"{instructions}\n\n{block}" if instructions else block


def summary_turns(turns: list[Turn], request: str | None = None) -> list[Turn]:
    """The turns of the compaction pass: the history, then the summarizing request (`request`: one the
    client gave, as Anthropic's `instructions`, in place of kvserve's)."""
    text = request or SUMMARY_REQUEST
    if turns and turns[-1].role == "user" and not turns[-1].marks:  # one user message: templates that alternate
        return [*turns[:-1], Turn("user", f"{turns[-1].content}\n\n{text}")]
    return [*turns, Turn("user", text)]
