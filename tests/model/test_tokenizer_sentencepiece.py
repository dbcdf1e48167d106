"""GGUF SentencePiece ("llama") tokenizers: a hand-made vocabulary, and Gemma 3's against a slow reference."""

import jinja2
import pytest

from kvserve.errors import ModelLoadError
from kvserve.model.gguf import load_gguf
from kvserve.model.loader import gemma3_270m_path
from kvserve.engine.output.detokenizer import IncrementalDetokenizer
from kvserve.model.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"


def spm_metadata(pieces: list[tuple[str, float, int]], **flags) -> dict:
    """`tokenizer.*` metadata as llama.cpp writes a SentencePiece vocabulary: (piece, score, type) per id."""
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p for p, _, _ in pieces],
        "tokenizer.ggml.scores": [s for _, s, _ in pieces],
        "tokenizer.ggml.token_type": [t for _, _, t in pieces],
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
    }
    meta.update({f"tokenizer.ggml.{key}": value for key, value in flags.items()})
    return meta


SPECIALS = [("<pad>", 0.0, CONTROL), ("<eos>", 0.0, CONTROL), ("<bos>", 0.0, CONTROL), ("<unk>", 0.0, UNKNOWN),
            ("<start_of_turn>", 0.0, CONTROL), ("\n", -1000.0, USER_DEFINED), ("  ", -1000.0, USER_DEFINED)]
BYTES = [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
# "ab" comes first in the file but "bc" scores higher: the score is what ranks a merge.
NORMALS = [(SPACE, -0.0, NORMAL), ("a", -1.0, NORMAL), ("b", -2.0, NORMAL), ("c", -3.0, NORMAL),
           ("h", -4.0, NORMAL), ("i", -5.0, NORMAL), ("ab", -9.0, NORMAL), ("bc", -6.0, NORMAL),
           ("hi", -7.0, NORMAL), (SPACE + "hi", -8.0, NORMAL)]
TINY = SPECIALS + BYTES + NORMALS


def tiny_tokenizer(**flags) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_metadata(TINY, **flags))


def ids(*pieces: str) -> list[int]:
    by_piece = {piece: i for i, (piece, _, _) in enumerate(TINY)}
    return [by_piece[piece] for piece in pieces]


def test_pieces_merge_best_score_first():
    tok = tiny_tokenizer(add_space_prefix=False)
    assert tok.encode("abc", add_special_tokens=False) == ids("a", "bc")
    assert tok.encode("hi hi") == ids("<bos>", "hi", SPACE + "hi")  # BOS: llama.cpp's default for SentencePiece
    assert tok.decode(tok.encode("hi hi")) == "hi hi"


def test_bytes_user_defined_and_control_tokens():
    tok = tiny_tokenizer(add_space_prefix=False, add_bos_token=False)
    assert tok.encode("é") == ids("<0xC3>", "<0xA9>")  # not a piece: its UTF-8 bytes
    assert tok.decode(tok.encode("é")) == "é"
    # user-defined pieces are matched whole, before merging, and are not special
    assert tok.encode("hi  hi\n") == ids("hi", "  ", "hi", "\n")
    assert tok.decode(tok.encode("hi  hi\n")) == "hi  hi\n"
    assert tok.encode("<start_of_turn>hi") == ids("<start_of_turn>", "hi")
    assert tok.decode(ids("<start_of_turn>", "hi")) == "hi"  # control tokens are skipped
    assert tok.stop_token_ids == {1}


def test_space_prefix_as_llama_cpp_adds_it():
    tok = tiny_tokenizer(add_bos_token=False)  # add_space_prefix: llama.cpp's default, true
    assert tok.encode("hi hi") == ids(SPACE + "hi", SPACE + "hi")
    assert tok.decode(tok.encode("hi hi")) == "hi hi"


def test_other_tokenizer_models_are_refused():
    with pytest.raises(ModelLoadError, match="'t5' is not supported"):
        Tokenizer.from_gguf_metadata(spm_metadata(TINY, model="t5"))


# --- Gemma 3's vocabulary (the packaged 270M GGUF) ---------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_meta():
    try:
        path = gemma3_270m_path()
    except ModelLoadError as exc:
        pytest.skip(f"Gemma 3 270M is not available: {exc}")
    return load_gguf(path).tokenizer_metadata


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_meta):
    return Tokenizer.from_gguf_metadata(gemma_meta)


# Verified once against transformers 5.23's tokenizer built from this GGUF (AutoTokenizer with gguf_file=), which
# agreed with ours on 2,179 texts (207k characters: this repository's docs and code, random Unicode) except runs
# of 32+ spaces (see test_long_space_runs_match_sentencepiece).
PINNED = {
    "Hello world!": [2, 9259, 1902, 236888],
    " leading space": [2, 5830, 2557],
    "a  b   c": [2, 236746, 138, 236763, 139, 236755],
    "line1\nline2\n\n": [2, 1257, 236770, 107, 1257, 236778, 108],
    "12345 3.14": [2, 236770, 236778, 236800, 236812, 236810, 236743, 236800, 236761, 236770, 236812],
    "émojis 🎉 中文": [2, 236859, 1289, 92467, 204906, 17346, 237364],
    "<start_of_turn>user\nhi<end_of_turn>\n": [2, 105, 2364, 107, 2202, 106, 107],
}


@pytest.mark.parametrize("text", sorted(PINNED))
def test_pinned_ids(gemma_tokenizer, text):
    assert gemma_tokenizer.encode(text) == PINNED[text]
    assert gemma_tokenizer.decode(PINNED[text], skip_special_tokens=False) == "<bos>" + text


def sentencepiece_reference(text: str, meta: dict) -> list[int]:
    """SentencePiece's BPE encoding, slowly, from the vocabulary's scores: spaces become "▁"; control and
    user-defined pieces are cut out whole, longest first; then the adjacent pair whose concatenation is the
    highest-scoring normal piece merges (leftmost on a tie) until none does; what is not a piece becomes bytes."""
    tokens, scores, types = (meta[f"tokenizer.ggml.{key}"] for key in ("tokens", "scores", "token_type"))
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    whole = {t.replace(" ", SPACE): i for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)}
    byte_ids = {t: i for i, t in enumerate(tokens) if types[i] == BYTE}
    longest = max(map(len, whole))
    out: list[int] = []

    def encode_run(symbols: list[str]) -> None:
        while True:
            best = None  # (score, position)
            for j in range(len(symbols) - 1):
                merged = normal.get(symbols[j] + symbols[j + 1])
                if merged is not None and (best is None or scores[merged] > best[0]):
                    best = (scores[merged], j)
            if best is None:
                break
            j = best[1]
            symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
        for symbol in symbols:
            out.extend([normal[symbol]] if symbol in normal else [byte_ids[f"<0x{b:02X}>"] for b in symbol.encode()])

    text, run, i = text.replace(" ", SPACE), [], 0
    while i < len(text):
        match = next((text[i:i + n] for n in range(longest, 0, -1) if text[i:i + n] in whole), None)
        if match is None:
            run.append(text[i])
            i += 1
        else:
            encode_run(run)
            run = []
            out.append(whole[match])
            i += len(match)
    encode_run(run)
    return out


CORPUS = [
    "The quick brown fox jumps over the lazy dog, then naps.",
    "Prefix caching lets identical prompt prefixes share physical KV blocks across requests and chat turns.",
    "def attend(q, k, v):\n    scores = q @ k.T / math.sqrt(d)\n\treturn softmax(scores) @ v  # done\n",
    "Numbers: 3.14159, 2,718 and 1e-6; dates 2026-11-22; ids #4821.",
    "Ünïcödé: naïve café, Straße,日本語のテキスト, 한국어, العربية, Ελληνικά, русский текст.",
    "Emoji 🎉👍🏽🫩 and symbols ∑∫√≈≠ ©®™ «quotes» “curly” — dashes…",
    "<table><tr><td>cell</td></tr></table> <start_of_turn>model\nok<end_of_turn>",
    "   indented    with     runs      of spaces\n\n\n\tand\t\ttabs",
    "literal \u2581 markers\u2581\u2581inside",
]


@pytest.mark.parametrize("text", CORPUS)
def test_matches_a_slow_sentencepiece_reference(gemma_tokenizer, gemma_meta, text):
    assert gemma_tokenizer.encode(text, add_special_tokens=False) == sentencepiece_reference(text, gemma_meta)
    if SPACE not in text:
        assert gemma_tokenizer.decode(gemma_tokenizer.encode(text), skip_special_tokens=False) == "<bos>" + text


def test_long_space_runs_match_sentencepiece(gemma_tokenizer, gemma_meta):
    # Gemma's longest space piece is 31 spaces: a longer run takes it first, as SentencePiece and llama.cpp
    # do. (transformers' GGUF tokenizer merges such runs as BPE pairs instead: 16 + 24 for these 40.)
    text = "x" + " " * 40 + "y"
    assert gemma_tokenizer.encode(text, add_special_tokens=False) == sentencepiece_reference(text, gemma_meta)
    assert gemma_tokenizer.encode(text, add_special_tokens=False)[1:3] == [167, 145]  # 31 + 9 spaces


def test_stops_and_bos(gemma_tokenizer):
    assert (gemma_tokenizer.bos_token, gemma_tokenizer.eos_token) == ("<bos>", "<eos>")
    assert {1, 106} <= gemma_tokenizer.stop_token_ids  # <eos>, <end_of_turn>
    assert gemma_tokenizer.encode("hi", add_special_tokens=False) == [2202]


def test_incremental_detokenization_holds_back_byte_pieces(gemma_tokenizer):
    text = "Rare emoji 🫩 then text"
    ids = gemma_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(gemma_tokenizer.encode("Rare emoji  then text", add_special_tokens=False)) + 1  # bytes
    detok = IncrementalDetokenizer(gemma_tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


# Written for this test in the shape of Gemma's chat templates (the packaged base model ships none): a system
# message folded into the first user turn, "assistant" spelt "model", roles checked with raise_exception.
GEMMA_STYLE_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set preamble = messages[0]['content'] | trim + '\\n\\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set preamble = '' -%}{%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if (message['role'] == 'user') != loop.index0 is even -%}
    {{ raise_exception('turns must alternate user/assistant') }}
  {%- endif -%}
  {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' }}
  {{- (preamble if loop.first else '') + message['content'] | trim }}<end_of_turn>
{{ '' }}
{%- endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}"""


def test_gemma_style_chat_template(gemma_meta):
    tokenizer = Tokenizer.from_gguf_metadata({**gemma_meta, "tokenizer.chat_template": GEMMA_STYLE_TEMPLATE})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.encode_chat(messages)
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids[-3:] == [105, 4368, 107]  # <start_of_turn>model\n
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        tokenizer.apply_chat_template(messages[1:2] * 2)
