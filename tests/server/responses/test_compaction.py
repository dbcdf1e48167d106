"""/v1/responses/compact and `context_management` compaction on create, through the official `openai`
client, in process on the tiny model (1,024-token context, character tokenizer): the shape of the
compaction, continuing from its item computes fewer tokens and the next turn hits the summary's blocks,
a forged or another tenant's item is a 400, and a threshold compacts before answering (stream too)."""

import openai
import pytest

from kvserve.server.prompt.builder import Conversation, PromptBuilder
from kvserve.tools.rendering import Turn
from tests.server.inprocess import serve_in_process, tiny_tokenizer

BS = 16
KEYS = ["alice-key", "bob-key"]
INSTRUCTIONS = "Be brief."


@pytest.fixture(scope="module")
def app(tiny_long_model):
    with serve_in_process(tiny_long_model, api_keys=KEYS, admin_key="admin-key") as client:
        yield client


def client_for(app, key="alice-key"):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=app, max_retries=0)


def assert_idle_and_intact(app):
    report = app.get("/v1/kv_cache", headers={"Authorization": "Bearer alice-key"}).json()
    assert report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0, report
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok", report


def ten_turns() -> list[dict]:
    history = []
    for n in range(5):
        history += [{"role": "user", "content": f"Fact {n}: the box holds {n} red balls."},
                    {"role": "assistant", "content": f"Noted, {n} red balls."}]
    return history


def turn_tokens(text: str) -> int:
    """The tokens a user message adds after the instructions segment, up to the generation prompt."""
    builder = PromptBuilder(tiny_tokenizer())
    prompt = builder.build(Conversation([Turn("user", text)], instructions=INSTRUCTIONS, split_instructions=True))
    return len(prompt.token_ids) - prompt.num_instruction_tokens


def items(output) -> list[dict]:
    return [item.model_dump(exclude_none=True, warnings=False) for item in output]


def test_compact_returns_the_user_messages_then_one_item_and_continuing_hits_the_summary(app):
    client = client_for(app)
    history = ten_turns()
    compacted = client.responses.compact(model="tiny", input=history, instructions=INSTRUCTIONS)
    assert compacted.object == "response.compaction"
    *messages, item = compacted.output
    assert [(m.role, m.content[0].text) for m in messages] == [(h["role"], h["content"]) for h in history
                                                               if h["role"] == "user"]
    assert item.type == "compaction" and item.id.startswith("cmp_") and item.encrypted_content
    assert "red balls" not in item.encrypted_content  # opaque to the client
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0

    verbatim = client.responses.create(model="tiny", instructions=INSTRUCTIONS, max_output_tokens=4, temperature=0,
                                       input=history + [{"role": "user", "content": "How many?"}], store=False)
    first = client.responses.create(model="tiny", instructions=INSTRUCTIONS, max_output_tokens=4, temperature=0,
                                    input=items(compacted.output) + [{"role": "user", "content": "How many?"}])
    # the summary (at most a quarter of the context) stands for the ten turns: fewer tokens to compute
    assert first.usage.input_tokens - first.usage.input_tokens_details.cached_tokens < verbatim.usage.input_tokens
    summary_prefix = first.usage.input_tokens - turn_tokens("How many?")  # instructions + summary
    assert summary_prefix > len(INSTRUCTIONS)
    # the client resends the compacted history, the answer and a new question: the summary's blocks hit
    second = client.responses.create(
        model="tiny", instructions=INSTRUCTIONS, max_output_tokens=4, temperature=0,
        input=items(compacted.output) + [{"role": "user", "content": "How many?"}] + items(first.output)
        + [{"role": "user", "content": "And then?"}])
    assert second.usage.input_tokens_details.cached_tokens >= summary_prefix // BS * BS > 0
    # ... and by previous_response_id, every block of the previous turn
    third = client.responses.create(model="tiny", instructions=INSTRUCTIONS, max_output_tokens=4, temperature=0,
                                    input="Why?", previous_response_id=first.id)
    before = first.usage.input_tokens + first.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= (before - 1) // BS * BS
    assert_idle_and_intact(app)


def test_a_forged_or_another_tenants_item_is_a_400(app):
    alice, bob = client_for(app, "alice-key"), client_for(app, "bob-key")
    compacted = alice.responses.compact(model="tiny", input=ten_turns()[:4])
    item = compacted.output[-1].model_dump(exclude_none=True, warnings=False)
    forged = dict(item, encrypted_content=item["encrypted_content"][:-8] + "AAAAAAAA")
    for client, sent in ((bob, item), (alice, forged), (alice, dict(item, encrypted_content="made up"))):
        with pytest.raises(openai.BadRequestError, match="not one this server issued"):
            client.responses.create(model="tiny", input=[sent, {"role": "user", "content": "Go on."}],
                                    max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="not one this server issued"):
            client.responses.compact(model="tiny", input=[sent, {"role": "user", "content": "Go on."}])
    assert_idle_and_intact(app)


def test_a_threshold_compacts_before_answering_and_counts_the_pass(app):
    client = client_for(app)
    history = ten_turns() + [{"role": "user", "content": "How many red balls in all?"}]
    plain = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=history, max_output_tokens=4,
                                    temperature=0, context_management=[{"type": "compaction",
                                                                        "compact_threshold": 10_000}])
    assert [o.type for o in plain.output] == ["message"]  # under the threshold: nothing to fold
    reply = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=history, max_output_tokens=4,
                                    temperature=0, context_management=[{"type": "compaction",
                                                                        "compact_threshold": 100}])
    assert [o.type for o in reply.output] == ["compaction", "message"]
    answer_prompt = len(INSTRUCTIONS) + turn_tokens(history[-1]["content"])
    # usage: the pass (the history and the request to summarize) plus the answer's prompt (summary + last turn)
    assert reply.usage.input_tokens > plain.usage.input_tokens + answer_prompt - len(INSTRUCTIONS)
    assert reply.usage.output_tokens > 4
    # the pass's prompt starts with the history the plain request cached
    assert reply.usage.input_tokens_details.cached_tokens >= BS
    # continuing by previous_response_id keeps the summary: the prompt starts with its blocks
    follow = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input="And blue?", max_output_tokens=4,
                                     temperature=0, previous_response_id=reply.id)
    assert follow.usage.input_tokens < plain.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= BS

    events = list(client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=history, max_output_tokens=4,
                                          temperature=0, stream=True, store=False,
                                          context_management=[{"type": "compaction", "compact_threshold": 100}]))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.compaction.compacting", "response.output_item.done"]
    assert events[2].item.type == "compaction" and events[2].output_index == 0
    assert all(e.output_index == 1 for e in events[5:-1] if hasattr(e, "output_index"))
    final = events[-1].response
    assert [o.type for o in final.output] == ["compaction", "message"]
    assert final.output[0].encrypted_content == events[4].item.encrypted_content
    # the lab's recent requests show the KV held before (the pass: the whole history) and after (the answer)
    recent = app.get("/lab/api/recent", headers={"Authorization": "Bearer admin-key"}).json()["requests"]
    answer, compaction_pass = recent[0], recent[1]
    assert compaction_pass["compaction_pass"] and not answer["compaction_pass"]
    assert compaction_pass["kv_tokens"] > plain.usage.input_tokens > answer["kv_tokens"]
    assert_idle_and_intact(app)
