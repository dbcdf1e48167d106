"""kvserve's tokenizer as llguidance sees it: every token's bytes and the end-of-generation tokens.

llguidance reads the tokenizer's own HF `tokenizers` JSON (byte-level BPE, SentencePiece byte fallback,
added and special tokens), so the bytes it matches are exactly the bytes kvserve decodes. A tokenizer whose
decoder it does not know (a plain character vocabulary joined by a Fuse decoder) is given token by token:
each token's decoded text, special tokens marked as llguidance marks them (a 0xFF byte, then the name).
Building it walks the whole vocabulary (~0.4 s at 49,152 tokens): once per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance

from kvserve.errors import TokenizerUnavailableError
from kvserve.model.tokenizer import Tokenizer

SPECIAL_TOKEN_MARK = b"\xff"


def build_grammar_vocabulary(tokenizer: Tokenizer | None, vocab_size: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over the model's `vocab_size` logits (ids past the tokenizer's own vocabulary
    have no bytes, so a grammar never allows them); every stop token of the model counts as EOS."""
    if tokenizer is None:
        raise TokenizerUnavailableError("structured outputs need a tokenizer; this model was loaded without one")
    eos = sorted(tokenizer.stop_token_ids)
    try:
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
    except ValueError:  # a decoder llguidance cannot read
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable.of(tokenizer, vocab_size, eos)),
                                      n_vocab=vocab_size, eos_token=eos or None)


@dataclass
class _TokenTable:
    """What llguidance's TokenizerWrapper reads: token bytes by id, EOS/BOS, special ids, and encode."""

    tokenizer: Tokenizer
    tokens: list[bytes]
    eos_token_id: int | None
    bos_token_id: int | None
    special_token_ids: list[int]

    @classmethod
    def of(cls, tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> "_TokenTable":
        special = {i: token.content for i, token in tokenizer.backend.get_added_tokens_decoder().items()
                   if token.special}
        tokens = [SPECIAL_TOKEN_MARK + special[i].encode() if i in special
                  else tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(vocab_size)]
        return cls(tokenizer, tokens, eos[0] if eos else None, tokenizer.bos_token_id, sorted(special))

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_special_tokens=False)
