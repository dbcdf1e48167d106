"""Generated call tokens kept per tenant, bounded, and spliced back only where the answer is unchanged."""

from kvserve.server.prompt.answers import GeneratedAnswers
from kvserve.server.prompt.builder import Conversation, PromptBuilder
from kvserve.tools.calls import ToolCall, calls_text
from kvserve.tools.rendering import Turn
from tests.server.inprocess import tiny_tokenizer

CALL = ToolCall("call_1", "f", '{"a": 1}')
TEXT = calls_text([CALL])


def test_answers_are_per_tenant_and_bounded():
    store = GeneratedAnswers(max_tokens=10)
    store.remember("alice", "call_1", TEXT, [7] * 6)
    turn = Turn("assistant", "", [CALL])
    assert store.lookup("alice", turn).token_ids == (7,) * 6
    assert store.lookup("bob", turn) is None
    assert store.lookup("alice", Turn("user", "hi")) is None
    store.remember("alice", "call_2", "x", [8] * 6)  # 12 tokens > 10: the least recently used goes
    assert store.lookup("alice", turn) is None


def test_only_a_forwarding_store_queues_what_it_remembers():
    quiet, forwarding = GeneratedAnswers(), GeneratedAnswers(forward=True)
    for store in (quiet, forwarding):
        store.remember("alice", "call_1", TEXT, [7, 8])
    assert quiet.take_new() == []
    [answer] = forwarding.take_new()
    assert (answer.tenant, answer.call_id, answer.text, answer.token_ids) == ("alice", "call_1", TEXT, (7, 8))
    assert forwarding.take_new() == []


def test_the_generated_ids_replace_the_answer_and_its_end_of_turn_is_not_doubled():
    tokenizer = tiny_tokenizer()
    turns = [Turn("user", "hi"), Turn("assistant", "", [CALL]), Turn("tool", "1", tool_call_id="call_1"),
             Turn("user", "ok")]
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    generated = tuple(tokenizer.encode("X", add_special_tokens=False) + end)  # the model's own ids for TEXT
    answers = GeneratedAnswers()
    answers.remember("alice", "call_1", TEXT, generated)
    builder = PromptBuilder(tokenizer, answers)
    ids = builder.build(Conversation(turns, tenant="alice")).token_ids
    head = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    tail = tokenizer.encode("\n<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n"
                            "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ids == head + list(generated) + tail
    # another tenant, or an answer edited since, is rendered and tokenized as text
    plain = tokenizer.encode(tokenizer.apply_chat_template(builder.messages(Conversation(turns))[0]),
                             add_special_tokens=False)
    assert builder.build(Conversation(turns, tenant="bob")).token_ids == plain
    edited = [turns[0], Turn("assistant", "", [ToolCall("call_1", "f", '{"a":1}')]), *turns[2:]]
    assert builder.build(Conversation(edited, tenant="alice")).token_ids[:len(head) + 1] != head + [generated[0]]
