"""The Conversations API through the official `openai` client, in process on the tiny model: CRUD and
items, `conversation` on responses.create (each turn hits every block of the one before), tenants (404),
exclusive with previous_response_id, and a restart with --responses-store-path keeps conversations and
compaction items alike."""

import openai
import pytest

from tests.server.inprocess import serve_in_process

BS = 16
KEYS = ["alice-key", "bob-key"]


@pytest.fixture(scope="module")
def app(tiny_long_model):
    with serve_in_process(tiny_long_model, api_keys=KEYS) as client:
        yield client


def client_for(app, key="alice-key"):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=app, max_retries=0)


def assert_idle_and_intact(app):
    report = app.get("/v1/kv_cache", headers={"Authorization": "Bearer alice-key"}).json()
    assert report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0, report
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok", report


def test_four_turns_in_a_conversation_each_hit_every_block_of_the_one_before(app):
    client = client_for(app)
    conversation = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}],
                                               metadata={"topic": "names"})
    assert conversation.object == "conversation" and conversation.metadata == {"topic": "names"}
    total_before = 0
    for turn, question in enumerate(["Hello!", "What is my name?", "Spell it.", "Thanks."]):
        reply = client.responses.create(model="tiny", instructions="Be brief.", input=question, max_output_tokens=6,
                                        temperature=0, conversation=conversation.id)
        assert reply.conversation.id == conversation.id
        if turn:
            assert reply.usage.input_tokens > total_before
            assert reply.usage.input_tokens_details.cached_tokens >= (total_before - 1) // BS * BS > 0
        total_before = reply.usage.input_tokens + reply.usage.output_tokens
    listed = client.conversations.items.list(conversation.id, order="asc", limit=100)
    assert [(i.type, i.role) for i in listed.data] == [("message", "user")] + [("message", "user"),
                                                                              ("message", "assistant")] * 4
    assert listed.data[1].content[0].text == "Hello!" and listed.data[-1].content[0].text == reply.output_text
    assert_idle_and_intact(app)


def test_items_can_be_added_read_and_deleted_and_the_next_turn_sees_them(app):
    client = client_for(app)
    conversation = client.conversations.create()
    client.responses.create(model="tiny", input="First.", max_output_tokens=3, conversation={"id": conversation.id})
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "An aside."},
        {"type": "message", "role": "assistant", "content": "Noted."}])
    assert [i.type for i in added.data] == ["message", "message"] and added.first_id == added.data[0].id
    fetched = client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    assert fetched.content[0].text == "An aside."
    after_delete = client.conversations.items.delete(added.data[1].id, conversation_id=conversation.id)
    assert after_delete.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[1].id, conversation_id=conversation.id)
    desc = client.conversations.items.list(conversation.id, limit=2)
    assert desc.data[0].id == added.data[0].id and desc.has_more
    # the items changed by hand: the next turn renders them (the aside is in its prompt)
    reply = client.responses.create(model="tiny", input="Next.", max_output_tokens=3, conversation=conversation.id)
    assert reply.usage.input_tokens_details.cached_tokens >= BS  # the unchanged head still hits
    texts = [i.content[0].text for i in client.conversations.items.list(conversation.id, order="asc").data]
    assert texts[:4] == ["First.", texts[1], "An aside.", "Next."]
    updated = client.conversations.update(conversation.id, metadata={"k": "v"})
    assert updated.metadata == {"k": "v"} and client.conversations.retrieve(conversation.id).metadata == {"k": "v"}
    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.object == "conversation.deleted"
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="Hi.", max_output_tokens=2, conversation=conversation.id)


def test_another_tenants_conversation_is_a_404_and_previous_response_id_is_exclusive(app):
    alice, bob = client_for(app, "alice-key"), client_for(app, "bob-key")
    conversation = alice.conversations.create(items=[{"role": "user", "content": "Secret."}])
    for call in (lambda: bob.conversations.retrieve(conversation.id),
                 lambda: bob.conversations.items.list(conversation.id),
                 lambda: bob.conversations.delete(conversation.id),
                 lambda: bob.responses.create(model="tiny", input="Hi.", conversation=conversation.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    reply = alice.responses.create(model="tiny", input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="cannot be used together"):
        alice.responses.create(model="tiny", input="Hi.", conversation=conversation.id, previous_response_id=reply.id)
    assert alice.conversations.retrieve(conversation.id).id == conversation.id


def test_a_restart_keeps_conversations_and_compaction_items(tiny_long_model, tmp_path):
    with serve_in_process(tiny_long_model, api_keys=KEYS, responses_store_path=str(tmp_path)) as app:
        client = client_for(app)
        conversation = client.conversations.create()
        first = client.responses.create(model="tiny", input="Remember 42.", max_output_tokens=4, temperature=0,
                                        conversation=conversation.id)
        compacted = client.responses.compact(model="tiny", input=[{"role": "user", "content": "Remember 42."},
                                                                  {"role": "assistant", "content": "Done."}])
    assert sorted(p.name[:5] for p in tmp_path.glob("*_*.json")) == ["conv_", "resp_"]
    with serve_in_process(tiny_long_model, api_keys=KEYS, responses_store_path=str(tmp_path)) as app:
        client = client_for(app)
        items = client.conversations.items.list(conversation.id, order="asc").data
        assert [i.content[0].text for i in items] == ["Remember 42.", first.output_text]
        second = client.responses.create(model="tiny", input="What number?", max_output_tokens=4, temperature=0,
                                         conversation=conversation.id)
        # the same token ids continue (the KV itself is gone with the process: no disk tier here)
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        item = compacted.output[-1].model_dump(exclude_none=True, warnings=False)
        reply = client.responses.create(model="tiny", input=[item, {"role": "user", "content": "Go on."}],
                                        max_output_tokens=2)
        assert reply.status in ("completed", "incomplete")


def test_a_reasoning_item_is_kept_with_a_reasoning_id(app):
    """Every input item kind responses.create takes, a conversation takes too (schemathesis found a 500 here)."""
    client = client_for(app)
    created = client.conversations.create(items=[
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Thinking."}]},
        {"type": "message", "role": "user", "content": "Hi."}])
    items = client.conversations.items.list(created.id, order="asc")
    assert [i.type for i in items.data] == ["reasoning", "message"] and items.data[0].id.startswith("rs_")
