"""/v1/responses through the official `openai` client, in process on the tiny model: token-exact
continuation over turns, streaming events, the store (GET / DELETE / input_items, tenants), truncation."""

import openai
import pytest

from kvserve.server.prompt.builder import Conversation, PromptBuilder
from kvserve.server.prompt.segments import TurnSegments
from kvserve.tools.rendering import Turn
from tests.server.inprocess import serve_in_process, tiny_tokenizer, with_tiny_tokenizer

BS = 16
KEYS = ["alice-key", "bob-key"]


@pytest.fixture(scope="module")
def app(tiny_models):
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")), api_keys=KEYS) as client:
        yield client


def assert_idle_and_intact(app):
    report = app.get("/v1/kv_cache", headers={"Authorization": "Bearer alice-key"}).json()
    assert report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0, report
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok", report


def client_for(app, key="alice-key"):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=app, max_retries=0)


def test_a_follow_up_hits_every_full_block_of_every_earlier_turn(app):
    client = client_for(app)
    questions = ["Hi there.", "And then?", "Why so?", "Thanks!"]
    previous, total_before = None, 0
    for turn, question in enumerate(questions):
        reply = client.responses.create(model="tiny", instructions="Be brief.", input=question, max_output_tokens=6,
                                        temperature=0, previous_response_id=previous)
        usage = reply.usage
        assert reply.status in ("completed", "incomplete") and reply.output[0].type == "message"
        if turn:
            # Every block the previous turns computed (prompt and answer, all but the last sampled token,
            # whose K/V this turn computes) is a hit: the prompt starts with exactly those token ids.
            assert usage.input_tokens > total_before
            assert usage.input_tokens_details.cached_tokens >= (total_before - 1) // BS * BS > 0
        total_before = usage.input_tokens + usage.output_tokens
        previous = reply.id
    assert_idle_and_intact(app)


def test_continuation_is_the_stored_ids_plus_the_new_turn_as_a_full_render_would_tokenize_it():
    tokenizer = tiny_tokenizer()
    builder = PromptBuilder(tokenizer)
    renderer = TurnSegments(builder)
    first = [{"role": "user", "content": "Hi."}]
    prompt = builder.build(Conversation([Turn("user", "Hi.")], instructions="Be brief.", split_instructions=True))
    head = prompt.token_ids[:prompt.num_instruction_tokens]
    turn = prompt.token_ids[prompt.num_instruction_tokens:]
    assert head == renderer.instructions("Be brief.")
    assert head + turn == tokenizer.encode_chat([{"role": "system", "content": "Be brief."}] + first)
    for answer in ("Hello!<|im_end|>", "Hello, trunc"):  # ended on the end-of-turn token, or cut at a length
        output = tokenizer.encode(answer, add_special_tokens=False)
        follow_up = [{"role": "user", "content": "More?"}]
        continued = head + turn + output + renderer.close_answer(output) + renderer.next_turn(follow_up)
        history = [{"role": "system", "content": "Be brief."}, *first,
                   {"role": "assistant", "content": answer.removesuffix("<|im_end|>")}, *follow_up]
        assert continued == tokenizer.encode_chat(history)


def test_streaming_sends_openai_events_and_the_same_text(app):
    client = client_for(app)
    kwargs = dict(model="tiny", input="Say something.", max_output_tokens=8, temperature=0, store=False)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if full.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-4].text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    with pytest.raises(openai.BadRequestError):  # store=false: nothing to continue from
        client.responses.create(model="tiny", input="again", previous_response_id=full.id)


def test_stored_responses_belong_to_their_tenant(app):
    alice, bob = client_for(app, "alice-key"), client_for(app, "bob-key")
    reply = alice.responses.create(model="tiny", input=[{"role": "user", "content": "Hello"}], max_output_tokens=4,
                                   metadata={"topic": "greeting"})
    fetched = alice.responses.retrieve(reply.id)
    assert fetched.id == reply.id and fetched.output_text == reply.output_text
    assert fetched.metadata == {"topic": "greeting"}
    items = alice.responses.input_items.list(reply.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "Hello")]
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(reply.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        bob.responses.create(model="tiny", input="hi", previous_response_id=reply.id, max_output_tokens=2)
    alice.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(reply.id)


def test_truncation_auto_drops_the_oldest_turns_and_disabled_refuses_with_counts(app):
    client = client_for(app)
    previous = None
    for _ in range(4):  # ~4 x 50 tokens: the fifth turn cannot fit the tiny model's 256-token context
        reply = client.responses.create(model="tiny", instructions="Rules.", input="x" * 30, max_output_tokens=16,
                                        previous_response_id=previous, truncation="auto",
                                        extra_body={"ignore_eos": True})
        previous = reply.id
    with pytest.raises(openai.BadRequestError, match=r"the input is \d+ tokens .* context of 256 tokens"):
        client.responses.create(model="tiny", instructions="Rules.", input="x" * 30, max_output_tokens=16,
                                previous_response_id=previous, extra_body={"ignore_eos": True})
    kept = client.responses.create(model="tiny", instructions="Rules.", input="x" * 30, max_output_tokens=16,
                                   previous_response_id=previous, truncation="auto", extra_body={"ignore_eos": True})
    assert kept.usage.input_tokens + 16 <= 256 and kept.truncation == "auto"
    assert_idle_and_intact(app)


@pytest.mark.parametrize("extra, named", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input_image"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input_file"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "json_schema"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
])
def test_unsupported_features_are_refused_by_name(app, extra, named):
    body = {"model": "tiny", "input": "hi", **extra}
    response = app.post("/v1/responses", json=body, headers={"Authorization": "Bearer alice-key"})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]
