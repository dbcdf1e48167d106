"""Anthropic's `context_management` (beta) through the official `anthropic` client, in process on the tiny
model (1,024-token context): compaction past a trigger (the compaction block first, its usage in
`iterations` and not in the top-level fields, the next turn that sends the block back hits the summary's
blocks), pause_after_compaction, clearing old tool results, and the beta header each edit needs."""

import anthropic
import pytest

from kvserve.server.anthropic.context_edits import CLEARED
from kvserve.server.compaction.summary import compacted_instructions
from tests.server.inprocess import serve_in_process, tiny_tokenizer

KEYS = ["alice-key"]
BS = 16
SYSTEM = "You keep count of boxes."
COMPACT = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 100}}]}


@pytest.fixture(scope="module")
def app(tiny_long_model):
    with serve_in_process(tiny_long_model, api_keys=KEYS) as client:
        yield client


def client_for(app):
    return anthropic.Anthropic(base_url="http://testserver", api_key="alice-key", http_client=app, max_retries=0)


def history() -> list[dict]:
    messages = []
    for n in range(4):
        messages += [{"role": "user", "content": f"Box {n} holds {n} red balls."},
                     {"role": "assistant", "content": f"Noted: box {n}."}]
    return messages + [{"role": "user", "content": "How many balls in all?"}]


def assert_idle_and_intact(app):
    report = app.get("/v1/kv_cache", headers={"Authorization": "Bearer alice-key"}).json()
    assert report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0, report
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok", report


def test_compaction_leads_with_the_summary_and_the_next_turn_hits_its_blocks(app):
    client = client_for(app)
    plain = client.beta.messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=history(),
                                        betas=["compact-2026-01-12"],
                                        context_management={"edits": [{"type": "compact_20260112"}]})
    assert [b.type for b in plain.content] == ["text"]  # under the default trigger (150,000 tokens)
    reply = client.beta.messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=history(),
                                        betas=["compact-2026-01-12"], context_management=COMPACT)
    assert [b.type for b in reply.content] == ["compaction", "text"]
    summary = reply.content[0].content
    assert summary
    kinds = [i.type for i in reply.usage.iterations]
    assert kinds == ["compaction", "message"]
    compaction, message = reply.usage.iterations
    # the pass read the whole history (its head cached by the plain request); the answer's prompt is smaller
    assert compaction.input_tokens + compaction.cache_read_input_tokens > plain.usage.input_tokens
    assert compaction.cache_read_input_tokens >= BS
    assert reply.usage.input_tokens == message.input_tokens and reply.usage.output_tokens == message.output_tokens
    # the client appends the answer and asks on: everything before the block is dropped, the summary hits
    follow = history() + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                          {"role": "user", "content": "And blue?"}]
    nxt = client.beta.messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=follow,
                                      betas=["compact-2026-01-12"])
    system = f"<|im_start|>system\n{compacted_instructions(SYSTEM, summary)}<|im_end|>\n"
    prefix = len(tiny_tokenizer().encode(system, add_special_tokens=False))  # system prompt + summary
    assert nxt.usage.cache_read_input_tokens >= prefix // BS * BS > 0
    assert nxt.usage.input_tokens + nxt.usage.cache_read_input_tokens < plain.usage.input_tokens + 40
    assert_idle_and_intact(app)


def test_pause_after_compaction_returns_the_block_alone_whole_and_streamed(app):
    client = client_for(app)
    edits = {"edits": [{**COMPACT["edits"][0], "pause_after_compaction": True}]}
    reply = client.beta.messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=history(),
                                        betas=["compact-2026-01-12"], context_management=edits)
    assert reply.stop_reason == "compaction" and [b.type for b in reply.content] == ["compaction"]
    with client.beta.messages.stream(model="tiny", max_tokens=4, system=SYSTEM, messages=history(),
                                     betas=["compact-2026-01-12"], context_management=edits) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "compaction" and final.content[0].content
    assert_idle_and_intact(app)


def test_old_tool_results_are_cleared_past_the_trigger_keeping_the_last(app):
    client = client_for(app)
    tools = [{"name": "look", "description": "Look in a box.", "input_schema": {
        "type": "object", "properties": {"box": {"type": "integer"}}}}]
    messages = [{"role": "user", "content": "Look in every box."}]
    for n in range(2):  # (the tool block alone is ~600 tokens of the 1,024)
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{n}", "name": "look",
                                                        "input": {"box": n}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}",
                                                   "content": f"{n}: many things " * 5}]}]
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 50},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    whole = client.messages.count_tokens(model="tiny", messages=messages, tools=tools).input_tokens
    reply = client.beta.messages.create(model="tiny", max_tokens=2, messages=messages, tools=tools,
                                        betas=["context-management-2025-06-27"], context_management=edits)
    applied = reply.context_management.applied_edits
    assert [(e.type, e.cleared_tool_uses) for e in applied] == [("clear_tool_uses_20250919", 1)]
    assert applied[0].cleared_input_tokens > len("0: many things " * 5) - len(CLEARED) - 10
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == whole - applied[0].cleared_input_tokens
    assert_idle_and_intact(app)


def test_each_edit_needs_its_beta_header(app):
    client = client_for(app)
    with pytest.raises(anthropic.BadRequestError, match="compact-2026-01-12"):
        client.beta.messages.create(model="tiny", max_tokens=2, messages=history(), context_management=COMPACT)
    with pytest.raises(anthropic.BadRequestError, match="context-management-2025-06-27"):
        client.beta.messages.create(model="tiny", max_tokens=2, messages=history(), betas=["compact-2026-01-12"],
                                    context_management={"edits": [{"type": "clear_tool_uses_20250919"}]})
