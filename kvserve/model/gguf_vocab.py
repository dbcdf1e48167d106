"""A GGUF file's vocabulary metadata -> a `tokenizers` spec: byte-level BPE (GPT-2 style, with the
pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`) or SentencePiece BPE."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.pre` -> tokenizers pre-tokenizer, mirroring llama.cpp's table.
_GPT2_REGEX_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _split_then_bytes(regex: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


_DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2_REGEX_PRE],
}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    # SmolLM and StarCoder split every digit on its own, then GPT-2's regex.
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "gpt-2": _GPT2_REGEX_PRE,
    "default": _GPT2_REGEX_PRE,
    "llama-bpe": _split_then_bytes(_LLAMA3_REGEX),
    "llama3": _split_then_bytes(_LLAMA3_REGEX),
    "qwen2": _split_then_bytes(_QWEN2_REGEX),
}

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SPACE = "\u2581"  # SentencePiece writes a space as "▁"


def byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """tokenizers' spec (less added tokens and post-processing) of a GGUF byte-level BPE vocabulary."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        log.warning("GGUF pre-tokenizer %r is unknown; using GPT-2 splitting (tokens may differ)", pre)
    return {
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS.get(pre, _GPT2_REGEX_PRE),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": list(meta.get("tokenizer.ggml.merges", [])),
        },
    }


def sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> dict[str, Any]:
    """tokenizers' spec of a GGUF SentencePiece ("llama") vocabulary, encoding as SentencePiece's BPE does.

    Spaces become "▁" (with one prepended when `add_space_prefix`, llama.cpp's default; Gemma sets it
    false), characters outside the vocabulary fall back to their UTF-8 bytes (<0xNN>), and
    adjacent pieces merge best-first while their concatenation is a normal vocabulary entry. The file
    has no merge list: `_sentencepiece_merges` makes one.
    """
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    scores = list(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    # The prefix goes before each stretch of text between added tokens (as llama.cpp puts it after each
    # special token, and transformers' legacy Llama tokenizer does), and comes off the decoded text.
    normalizers = [{"type": "Prepend", "prepend": SPACE}] if add_prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
    ]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": tokens[unk_id] if unk_id is not None else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
            "ignore_merges": False, "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": _sentencepiece_merges(tokens, scores, types),
        },
    }


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """BPE merges that make tokenizers encode like SentencePiece: best first, (left, right) for every
    normal vocabulary entry that splits into two entries.

    SentencePiece (and llama.cpp) repeatedly merge the adjacent pair whose concatenation is a normal
    piece with the highest score, so a piece's score is its merges' rank (a SentencePiece BPE file
    lists pieces in that order anyway: Gemma's score -0, -1, -2, ... by id). Within one piece the
    longer left part comes first (the order transformers gives Gemma's merges).
    """
    ids = {token: i for i, token in enumerate(tokens)}
    normal = [i for i, kind in enumerate(types) if kind == TOKEN_TYPE_NORMAL]
    merges = []
    for i in sorted(normal, key=lambda i: -scores[i]):  # stable: file order among equal scores
        token = tokens[i]
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append([left, right])
    return merges
