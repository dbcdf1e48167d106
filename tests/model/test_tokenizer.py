"""Tokenizer from GGUF metadata and from tokenizer.json, chat template, streaming detokenization."""

import pytest

from kvserve.model.loader import embedded_model_path
from kvserve.engine.output.detokenizer import IncrementalDetokenizer
from kvserve.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "Numbers 1234567890 and 3.14159 split digit by digit",
    "  leading spaces,\n\nblank lines\tand tabs  ",
    "émojis 🎉🎉, accents àéîõü and 中文字符",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "it's they're we've I'm you'll he'd",
    "code: def f(x):\n    return x ** 2  # square",
]

MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
]


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(embedded_tokenizer, reference_tokenizer, text):
    assert embedded_tokenizer.encode(text) == reference_tokenizer(text).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(embedded_tokenizer, text):
    assert embedded_tokenizer.decode(embedded_tokenizer.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_individually_and_no_bos(embedded_tokenizer):
    ids = embedded_tokenizer.encode("2024")
    assert len(ids) == 4
    assert [embedded_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]
    assert embedded_tokenizer.encode("hi")[0] != embedded_tokenizer.bos_token_id


def test_special_tokens_and_stops(embedded_tokenizer):
    assert embedded_tokenizer.encode("<|im_end|>") == [2]
    assert embedded_tokenizer.eos_token == "<|im_end|>"
    assert {0, 2} <= embedded_tokenizer.stop_token_ids  # <|endoftext|> and <|im_end|>
    assert embedded_tokenizer.decode([2, 19556]) == "Hello"  # specials skipped by default


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_matches_transformers(embedded_tokenizer, reference_tokenizer, messages):
    ours = embedded_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    assert embedded_tokenizer.encode_chat(messages) == reference_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_tokenizer_json_directory(tmp_path, embedded_tokenizer, reference_tokenizer):
    reference_tokenizer.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_directory(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == embedded_tokenizer.encode(text)
    assert from_dir.apply_chat_template(MESSAGES[1]) == embedded_tokenizer.apply_chat_template(MESSAGES[1])
    assert from_dir.eos_token_id == 2


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_joins_to_full_decode(embedded_tokenizer, text):
    ids = embedded_tokenizer.encode(text)
    detok = IncrementalDetokenizer(embedded_tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == embedded_tokenizer.decode(ids)
    for piece in pieces:
        assert "\ufffd" not in piece  # never a broken character


def test_detokenizer_holds_back_split_characters(embedded_tokenizer):
    # 🎉 is four UTF-8 bytes spread over several byte-level tokens.
    ids = embedded_tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(embedded_tokenizer)
    pieces = [detok.add(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🎉"


def test_flush_emits_an_incomplete_tail(embedded_tokenizer):
    ids = embedded_tokenizer.encode("🎉")[:-1]
    detok = IncrementalDetokenizer(embedded_tokenizer)
    joined = "".join(detok.add(i) for i in ids) + detok.flush()
    assert joined == embedded_tokenizer.decode(ids)


def test_a_gguf_tokenizer_loads_without_the_weights():
    """What an ingress or router tokenizes with: the GGUF header's vocabulary, equal to a loaded model's."""
    from kvserve.model.gguf import load_gguf
    from kvserve.model.loader import embedded_model_path, load_tokenizer

    alone = load_tokenizer()
    with_model = Tokenizer.from_gguf_metadata(load_gguf(embedded_model_path()).tokenizer_metadata)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Caching, in a haiku?"}]
    assert alone.encode_chat(messages) == with_model.encode_chat(messages)
    assert alone.chat_template == with_model.chat_template and alone.eos_token_id == with_model.eos_token_id
