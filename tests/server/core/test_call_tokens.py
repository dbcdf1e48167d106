"""Generated call tokens kept per tenant, bounded, and spliced back only where the answer is unchanged."""

from kvserve.server.core.call_tokens import CallTokens, encode_spliced
from kvserve.tools.calls import ToolCall, calls_text
from kvserve.tools.rendering import Turn
from tests.server.inprocess import tiny_tokenizer

CALL = ToolCall("call_1", "f", '{"a": 1}')
TEXT = calls_text([CALL])


def test_answers_are_per_tenant_unchanged_only_and_bounded():
    store = CallTokens(max_tokens=10)
    store.remember("alice", "call_1", TEXT, [7] * 6)
    turns = [Turn("user", "hi"), Turn("assistant", "", [CALL])]
    assert store.generated("alice", turns) == {TEXT: (7,) * 6}
    assert store.generated("bob", turns) == {}
    edited = [Turn("user", "hi"), Turn("assistant", "", [ToolCall("call_1", "f", '{"a":1}')])]
    assert store.generated("alice", edited) == {}
    store.remember("alice", "call_2", "x", [8] * 6)  # 12 tokens > 10: the least recently used goes
    assert store.generated("alice", turns) == {}


def test_the_generated_ids_replace_the_answer_and_its_end_of_turn_is_not_doubled():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TEXT},
                {"role": "user", "content": "ok"}]
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    generated = tuple(tokenizer.encode("X", add_special_tokens=False) + end)  # the model's own ids for TEXT
    ids = encode_spliced(tokenizer, messages, True, {}, {TEXT: generated})
    head = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    tail = tokenizer.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ids == head + list(generated) + tail
    assert encode_spliced(tokenizer, messages, True, {}, {}) is None
